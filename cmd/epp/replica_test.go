package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvepp/kvepp/internal/binarytest"
)

// eppReplica is one epp process of TestReplicasAsProcesses and its ports.
type eppReplica struct {
	p                  *binarytest.Process
	selection, replica int
	ports              []int
}

func (r *eppReplica) url(path string) string {
	return fmt.Sprintf("http://127.0.0.1:%d%s", r.selection, path)
}

// startReplica runs an epp process with replica sync on ports[4] and peers; ports are ext_proc,
// health, selection, metrics, replica sync.
func startReplica(t *testing.T, ports []int, peers []int, extra ...string) *eppReplica {
	t.Helper()
	var eps []string
	for _, p := range peers {
		eps = append(eps, fmt.Sprintf("tcp://127.0.0.1:%d", p))
	}
	env := append([]string{
		"DYN_EPP_TOKENIZER_PROTOCOL=none", "DYN_ROUTER_USE_KV_EVENTS=false", "DYN_EPP_SECURE_SERVING=false",
		"DYN_EPP_DRAIN_TIMEOUT_SECS=0", "DYN_EPP_BIND_ADDRESS=127.0.0.1", "DYN_LOG=info",
		"DYN_EPP_REPLICA_SYNC_PEERS=" + strings.Join(eps, ","),
	}, extra...)
	p := startEPP(t, env, "--grpc-port", strconv.Itoa(ports[0]), "--grpc-health-port", strconv.Itoa(ports[1]),
		"--selection-http-port", strconv.Itoa(ports[2]), "--metrics-port", strconv.Itoa(ports[3]),
		"--replica-sync-port", strconv.Itoa(ports[4]))
	r := &eppReplica{p: p, selection: ports[2], replica: ports[4], ports: ports}
	// Ready (gRPC health SERVING, epp.md §11.1 step 6) comes after the index recovery.
	deadline := time.Now().Add(60 * time.Second)
	for !strings.Contains(p.Output(), `"message":"kvepp ready"`) {
		if time.Now().After(deadline) {
			t.Fatalf("epp never became ready; output:\n%s", p.Output())
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, id := range []int{1, 2} {
		body := fmt.Sprintf(`{"worker_id":%d,"model_name":"m","endpoint":"http://127.0.0.1:%d","block_size":4}`, id, 18000+id)
		if st := post(t, r.url("/workers"), body); st != http.StatusCreated {
			t.Fatalf("POST /workers: %d", st)
		}
	}
	return r
}

func post(t *testing.T, url, body string) int {
	t.Helper()
	resp, err := http.Post(url, "application/json", bytes.NewReader([]byte(body)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// activeRequests sums active_requests of GET /loads.
func activeRequests(t *testing.T, r *eppReplica) uint64 {
	t.Helper()
	resp, err := http.Get(r.url("/loads"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var pl []struct {
		Loads []struct {
			ActiveRequests uint64 `json:"active_requests"`
		} `json:"loads"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&pl); err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, p := range pl {
		for _, l := range p.Loads {
			n += l.ActiveRequests
		}
	}
	return n
}

// bookUntilSeen books on from until a booking shows on every replica of to (the first ones may
// precede the subscriptions), freeing each booking again.
func bookUntilSeen(t *testing.T, from *eppReplica, to ...*eppReplica) {
	t.Helper()
	end := time.Now().Add(30 * time.Second)
	for i := 0; ; i++ {
		id := fmt.Sprintf("b%d-%d", from.selection, i)
		if st := post(t, from.url("/select_and_reserve"), fmt.Sprintf(`{"model_name":"m","selection_id":%q,"token_ids":[1,2,3,4,5,6,7,8]}`, id)); st != http.StatusOK {
			t.Fatalf("select_and_reserve: %d", st)
		}
		seen := false
		for wait := time.Now().Add(time.Second); !seen && time.Now().Before(wait); time.Sleep(10 * time.Millisecond) {
			seen = true
			for _, r := range to {
				seen = seen && activeRequests(t, r) == 1
			}
		}
		req, _ := http.NewRequest(http.MethodDelete, from.url("/reservations/"+id), nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
		if seen {
			return
		}
		if time.Now().After(end) {
			t.Fatalf("a booking on :%d never reached every peer", from.selection)
		}
	}
}

// TestReplicasAsProcesses runs three epp processes with static replica-sync peers: a booking on
// one reaches the others; one is killed with SIGKILL and the other two go on; restarted on the
// same ports with the first as its recovery peer, it has the first's index when it serves and
// receives its bookings again.
func TestReplicasAsProcesses(t *testing.T) {
	ports := binarytest.FreePorts(t, 15)
	pa, pb, pc := ports[0:5], ports[5:10], ports[10:15]
	a := startReplica(t, pa, []int{pb[4], pc[4]})
	b := startReplica(t, pb, []int{pa[4], pc[4]})
	c := startReplica(t, pc, []int{pa[4], pb[4]})
	bookUntilSeen(t, a, b, c)
	bookUntilSeen(t, b, a, c)

	if err := c.p.Cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = c.p.Wait()
	bookUntilSeen(t, a, b)

	c2 := startReplica(t, pc, []int{pa[4], pb[4]}, fmt.Sprintf("DYN_EPP_INDEXER_PEERS=http://127.0.0.1:%d", pa[2]))
	dump := func(r *eppReplica) int {
		resp, err := http.Get(r.url("/dump"))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var d map[string]struct {
			Events []json.RawMessage `json:"events"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&d); err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, p := range d {
			n += len(p.Events)
		}
		return n
	}
	// Checked before anything else reaches c2: the index it serves with came from a's /dump.
	if want, got := dump(a), dump(c2); want == 0 || got != want {
		t.Fatalf("restarted replica serves an index of %d events, its recovery peer has %d", got, want)
	}
	bookUntilSeen(t, a, b, c2)
	bookUntilSeen(t, c2, a, b)
}
