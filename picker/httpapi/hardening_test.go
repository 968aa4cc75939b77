package httpapi_test

import (
	"strings"
	"testing"
)

// Tests of the fresh-user audit (issue 10): bounded ids and names, PATCH partition fields,
// bounded isl_tokens, model name validation, clearer readiness and schema errors.

// bigString is n bytes of 'x'.
func bigString(n int) string { return strings.Repeat("x", n) }

// wantBoundedError asserts status and that the raw error body is short (it quotes at most about
// 100 bytes of any client value) and contains every fragment.
func (e *env) wantBoundedError(status int, method, path, body string, frags ...string) string {
	e.t.Helper()
	st, raw := e.raw(method, path, body)
	if st != status {
		e.t.Fatalf("%s %s = %d %.300s, want %d", method, path, st, raw, status)
	}
	if len(raw) > 600 {
		e.t.Fatalf("%s %s: error body is %d bytes (%.200s…); it must not echo unbounded input", method, path, len(raw), raw)
	}
	var v map[string]any
	if err := jsonUnmarshal(raw, &v); err != nil {
		e.t.Fatalf("%s %s: body %q is not JSON: %v", method, path, raw, err)
	}
	msg := errMsg(e.t, v)
	for _, f := range frags {
		if !strings.Contains(msg, f) {
			e.t.Fatalf("%s %s: error %q does not contain %q", method, path, msg, f)
		}
	}
	return msg
}

func TestIDsAndNamesAreBoundedAtBookingAndRegistration(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	long := bigString(257)
	huge := bigString(2_000_000)

	t.Run("a selection_id over 256 bytes is a 400 stating the limit and books nothing", func(t *testing.T) {
		for _, id := range []string{long, huge} {
			e.wantBoundedError(400, "POST", "/select_and_reserve", `{"selection_id":"`+id+`","model_name":"model",`+prompt+`}`,
				"selection_id", "256 bytes")
			e.wantBoundedError(400, "POST", "/select", `{"selection_id":"`+id+`","model_name":"model",`+prompt+`}`,
				"selection_id", "256 bytes")
			e.wantBoundedError(400, "POST", "/reservations", `{"selection_id":"`+id+`","model_name":"model","worker_id":1,`+prompt+`}`,
				"selection_id", "256 bytes")
			e.wantBoundedError(400, "POST", "/reservations", `{"selection_id":"`+id+`","model_name":"model"}`,
				"selection_id", "256 bytes")
		}
		if n := e.totalRequests(); n != 0 {
			t.Fatalf("%v bookings after refused ids", n)
		}
	})
	t.Run("a selection_id of exactly 256 bytes books and frees", func(t *testing.T) {
		id := bigString(256)
		e.ok(200, "POST", "/select_and_reserve", `{"selection_id":"`+id+`","model_name":"model",`+prompt+`}`)
		e.ok(200, "DELETE", "/reservations/"+id, "")
	})
	t.Run("session ids over 256 bytes are a 400 stating the limit", func(t *testing.T) {
		e.wantBoundedError(400, "POST", "/select_and_reserve", `{"session_id":"`+long+`","model_name":"model",`+prompt+`}`,
			"session_id", "256 bytes")
		e.wantBoundedError(400, "POST", "/select", `{"session_context":{"session_id":"`+huge+`"},"model_name":"model",`+prompt+`}`,
			"session_id", "256 bytes")
	})
	t.Run("model names and routing groups over 256 bytes are a 400 stating the limit", func(t *testing.T) {
		e.wantBoundedError(400, "POST", "/workers", `{"worker_id":7,"model_name":"`+long+`"}`, "model_name", "256 bytes")
		e.wantBoundedError(400, "POST", "/workers", `{"worker_id":7,"routing_group":"`+huge+`"}`, "routing_group", "256 bytes")
		e.wantBoundedError(400, "POST", "/select", `{"model_name":"`+huge+`",`+prompt+`}`, "model_name", "256 bytes")
		e.wantBoundedError(400, "POST", "/overlap_scores", `{"routing_group":"`+long+`",`+prompt+`}`, "routing_group", "256 bytes")
		if st, _ := e.do("GET", "/workers", ""); st != 200 || len(e.core.Workers("", "")) != 1 {
			t.Fatalf("a refused registration changed the catalog: %v", e.core.Workers("", ""))
		}
	})
	t.Run("a lifecycle call for an unknown long id quotes at most about 100 bytes of it", func(t *testing.T) {
		id := bigString(600_000)
		for _, c := range []struct{ method, path string }{
			{"DELETE", "/reservations/" + id},
			{"POST", "/reservations/" + id + "/prefill_complete"},
			{"POST", "/reservations/" + id + "/output_block"},
		} {
			msg := e.wantBoundedError(404, c.method, c.path, "", "not found", "…")
			if strings.Contains(msg, bigString(101)) {
				t.Fatalf("%s quotes more than 100 bytes of the id: %q", c.method, msg)
			}
		}
	})
}

func TestADumpKeyNamesExactlyOnePartition(t *testing.T) {
	e := newEnv(t)
	t.Run("a routing_group with ':' is refused because the dump key splits at the last ':'", func(t *testing.T) {
		e.wantBoundedError(400, "POST", "/workers", `{"worker_id":45,"model_name":"a","routing_group":"b:c","endpoint":"http://w:1","block_size":4}`,
			"routing_group", "':'")
		e.wantBoundedError(400, "POST", "/select", `{"model_name":"a","routing_group":"b:c",`+prompt+`}`, "routing_group", "':'")
	})
	t.Run("model names with ':' keep working", func(t *testing.T) {
		e.ok(201, "POST", "/workers", `{"worker_id":44,"model_name":"a:b","routing_group":"c","endpoint":"http://w:1","block_size":4}`)
		e.ok(201, "POST", "/workers", `{"worker_id":46,"model_name":"llama3:8b","endpoint":"http://w:2","block_size":4}`)
		e.ok(200, "POST", "/select_and_reserve", `{"model_name":"llama3:8b",`+prompt+`}`)
		dump := obj(t, e.ok(200, "GET", "/dump", ""))
		if _, ok := dump["a:b:c"]; !ok || len(dump) != 2 {
			t.Fatalf("dump keys %v, want a:b:c and llama3:8b:default", keys(dump))
		}
	})
}

func TestPatchRefusesPartitionFields(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	for _, field := range []string{"model_name", "routing_group"} {
		t.Run("a PATCH naming "+field+" is a 400 naming the field", func(t *testing.T) {
			e.wantBoundedError(400, "PATCH", "/workers/1", `{"`+field+`":"other","total_kv_blocks":9}`, field, "POST /workers")
			w := e.core.Workers("", "")[0]
			if w.ModelName != "model" || w.RoutingGroup != "default" || w.TotalKVBlocks != nil {
				t.Fatalf("the refused PATCH changed the record: %+v", w.WorkerRecord)
			}
		})
	}
	t.Run("a null partition field is not supplied and the rest applies", func(t *testing.T) {
		v := obj(t, e.ok(200, "PATCH", "/workers/1", `{"model_name":null,"routing_group":null,"total_kv_blocks":9}`))
		if v["total_kv_blocks"] != 9.0 || v["model_name"] != "model" {
			t.Fatalf("PATCH = %v", v)
		}
	})
}

func TestISLTokensAreBounded(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	hashes := `"sequence_hashes":[1],"block_hashes":[1]`
	t.Run("an explicit reservation over 16777216 tokens is a 400 stating the limit", func(t *testing.T) {
		e.wantBoundedError(400, "POST", "/reservations",
			`{"selection_id":"r1","model_name":"model","worker_id":1,`+hashes+`,"isl_tokens":18446744073709551615}`,
			"isl_tokens", "16777216")
		if n := e.totalRequests(); n != 0 {
			t.Fatalf("%v bookings after a refused isl_tokens", n)
		}
	})
	t.Run("hash-form selections are bounded the same way", func(t *testing.T) {
		e.wantBoundedError(400, "POST", "/select_and_reserve", `{"model_name":"model",`+hashes+`,"isl_tokens":16777217}`,
			"isl_tokens", "16777216")
	})
	t.Run("16777216 tokens are accepted", func(t *testing.T) {
		e.ok(201, "POST", "/reservations", `{"selection_id":"r2","model_name":"model","worker_id":1,`+hashes+`,"isl_tokens":16777216}`)
		e.wantLoad(1, 0, 16777216, 1, 1)
	})
}

func TestModelNamesAreValidated(t *testing.T) {
	e := newEnv(t)
	reg := func(id int, model string) string {
		return `{"worker_id":` + itoa(id) + `,"model_name":"` + model + `","endpoint":"http://w:1","block_size":4}`
	}
	t.Run("invalid UTF-8 is refused, so two raw names never merge into one", func(t *testing.T) {
		e.wantBoundedError(400, "POST", "/workers", reg(1, "m\xff"), "UTF-8")
		e.wantBoundedError(400, "POST", "/workers", reg(2, "m\xfe"), "UTF-8")
		e.wantBoundedError(400, "POST", "/workers", reg(3, `m\udc80`), "model_name", "UTF-8")
		if ws := e.core.Workers("", ""); len(ws) != 0 {
			t.Fatalf("catalog %v", ws)
		}
	})
	t.Run("control characters are refused", func(t *testing.T) {
		for _, name := range []string{`m\u0000`, `m\n`, `\u007f`, `m\u0085`} {
			e.wantBoundedError(400, "POST", "/workers", reg(4, name), "model_name", "control character")
		}
		e.wantBoundedError(400, "POST", "/select", `{"model_name":"m\u0000",`+prompt+`}`, "model_name", "control character")
	})
	t.Run("a 1 MB name is refused", func(t *testing.T) {
		e.wantBoundedError(400, "POST", "/workers", reg(5, bigString(1<<20)), "model_name", "256 bytes")
	})
	t.Run("ordinary names, unicode included, are accepted", func(t *testing.T) {
		for i, name := range []string{"Qwen/Qwen3-0.6B", "llama3:8b", "модель ü", "a b"} {
			e.ok(201, "POST", "/workers", reg(10+i, name))
		}
	})
}

func TestNotReadyErrorsSayWhichCaseItIs(t *testing.T) {
	e := newEnv(t)
	for i := 1; i <= 7; i++ {
		e.ok(201, "POST", "/workers", `{"worker_id":`+itoa(i)+`,"model_name":"m`+itoa(i)+`","endpoint":"http://w:1","block_size":4}`)
	}
	e.ok(201, "POST", "/workers", `{"worker_id":20,"model_name":"broken","block_size":4}`)
	e.ok(201, "POST", "/workers", `{"worker_id":21,"model_name":"broken","endpoint":"http://w:1"}`)

	t.Run("an unknown model names up to 5 registered models", func(t *testing.T) {
		msg := e.fails(503, "no schedulable workers for nope:default", "POST", "/select", `{"model_name":"nope",`+prompt+`}`)
		for _, want := range []string{"no partition", "broken", "m1", "m2", "m3", "m4", "more"} {
			if !strings.Contains(msg, want) {
				t.Fatalf("error %q does not contain %q", msg, want)
			}
		}
		if strings.Contains(msg, "m7") {
			t.Fatalf("error %q lists more than 5 models", msg)
		}
	})
	t.Run("a partition whose workers are all unschedulable gives their reasons", func(t *testing.T) {
		msg := e.fails(503, "no schedulable workers for broken:default", "POST", "/select", `{"model_name":"broken",`+prompt+`}`)
		for _, want := range []string{"worker 20", "endpoint is required", "worker 21", "block_size must be greater than 0"} {
			if !strings.Contains(msg, want) {
				t.Fatalf("error %q does not contain %q", msg, want)
			}
		}
	})
}

func TestSchemaErrorsQuoteNumbersWholeWithTheirIndex(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	t.Run("a token id out of range is quoted whole with its index", func(t *testing.T) {
		e.fails(422, "token_ids[3]: expected an integer in [0, 4294967295], got JSON number 18446744073709551616",
			"POST", "/select", `{"model_name":"model","token_ids":[1,2,3,18446744073709551616]}`)
	})
	t.Run("a routing token id names its index", func(t *testing.T) {
		e.fails(422, "mm_routing_info.routing_token_ids[1]: expected an integer in [0, 4294967295], got JSON number -5",
			"POST", "/select", `{"model_name":"model","token_ids":[1],"mm_routing_info":{"routing_token_ids":[1, -5]}}`)
	})
	t.Run("a hash out of range is quoted whole with its index", func(t *testing.T) {
		e.fails(422, "sequence_hashes[1]: expected an integer hash in [-2^63, 2^64-1], got JSON number 18446744073709551616",
			"POST", "/select", `{"model_name":"model","block_hashes":[1,2],"sequence_hashes":[1,18446744073709551616],"isl_tokens":8}`)
	})
	t.Run("a worker id names its index", func(t *testing.T) {
		e.fails(422, "allowed_worker_ids[2]: expected an integer in [0, 18446744073709551615], got JSON number 18446744073709551616",
			"POST", "/select", `{"model_name":"model",`+prompt+`,"allowed_worker_ids":[1, 2, 18446744073709551616]}`)
	})
	t.Run("a very long number is cut with …", func(t *testing.T) {
		msg := e.wantBoundedError(422, "POST", "/select", `{"model_name":"model","token_ids":[`+strings.Repeat("9", 5000)+`]}`,
			"token_ids[0]", "got JSON number 99999", "…")
		if strings.Contains(msg, strings.Repeat("9", 120)) {
			t.Fatalf("error %q quotes more than about 100 bytes of the number", msg)
		}
	})
	t.Run("a string element is quoted and bounded", func(t *testing.T) {
		e.fails(422, `token_ids[1]: expected an integer in [0, 4294967295], got JSON string "a,b"`,
			"POST", "/select", `{"model_name":"model","token_ids":[1,"a,b",3]}`)
	})
}

func TestNullBodiesAndEmptyIDsGetClearAnswers(t *testing.T) {
	e := newEnv(t)
	e.worker(1, "")
	t.Run("a JSON null body is a 422 like any other non-object", func(t *testing.T) {
		for _, path := range []string{"/workers", "/select", "/select_and_reserve", "/reservations", "/overlap_scores"} {
			e.fails(422, "request body: expected an object, got JSON null", "POST", path, `null`)
		}
		e.fails(422, "request body: expected an object, got JSON null", "PATCH", "/workers/1", ` null `)
	})
	t.Run("a lifecycle call with an empty id says the id is empty", func(t *testing.T) {
		e.fails(400, "selection_id in the path is empty", "DELETE", "/reservations/", "")
		e.fails(400, "selection_id in the path is empty", "POST", "/reservations//prefill_complete", "")
		e.fails(400, "selection_id in the path is empty", "POST", "/reservations//output_block", "")
	})
}
