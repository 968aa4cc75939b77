package runner

import (
	"context"
	"fmt"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/internal/benchbody"
	"github.com/kvepp/kvepp/internal/sharedtest"
	"github.com/kvepp/kvepp/picker"
)

// BenchmarkExchange measures full ext_proc exchanges through the real runner with the Qwen3
// tokenizer and three workers configured as the README runs kvepp (KV events on, the workers'
// publishers not running), over loopback gRPC with the Envoy emulator: request headers, body,
// routing reply and re-streamed body, a three-chunk SSE response, end. Every request's last
// message is unique (benchbody.Body.Unique), as in real traffic. The bodies are the golden
// chat-long (12 KB, one user message) and conversations of 10, 20 and 30 turns of 7.5 KB whose
// last turn is new: a conversation continuing, whose decision time should not grow with the
// number of turns. It reports the decision time (end of stream → routing reply) p50 in µs and the
// process's CPU per exchange (client and server; steadier than wall time on a busy machine).
//
//	go test ./runner -run '^$' -bench Exchange -benchmem -cpuprofile cpu.out
func BenchmarkExchange(b *testing.B) {
	golden := sharedtest.RequestVectorNamed(b, "chat-long")
	cases := []struct {
		name string
		raw  []byte
		path string
	}{{"chat-long", golden.Body, golden.Path}}
	for _, turns := range []int{10, 20, 30} {
		cases = append(cases, struct {
			name string
			raw  []byte
			path string
		}{fmt.Sprintf("conv-%d-turns", turns), benchbody.Conversation(e2eModel, turns, benchbody.DefaultTurnBytes), ""})
	}
	cfg := loopbackConfig(b)
	inst := startInstance(b, cfg)
	ctx := context.Background()
	for id := uint64(1); id <= 3; id++ {
		bs := uint32(16)
		rec := picker.WorkerRecord{WorkerID: id, ModelName: e2eModel, Endpoint: fmt.Sprintf("http://127.0.0.1:%d", 18000+id), BlockSize: &bs,
			KVEventsEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", 18100+id)}
		if _, err := inst.Service.UpsertWorker(ctx, rec, picker.SourceAPI); err != nil {
			b.Fatal(err)
		}
	}
	client := extproctest.NewClient(dialPlain(b, inst.Addrs().GRPC))
	resp := &extproctest.Response{Status: 200, ContentType: "text/event-stream", Chunks: sseChunks()}
	for ci, c := range cases {
		body, err := benchbody.New(c.raw, c.path)
		if err != nil {
			b.Fatal(err)
		}
		b.Run(c.name, func(b *testing.B) {
			run := fmt.Sprintf("b%d-%d", ci, time.Now().UnixNano())
			do := func(n uint64) time.Duration {
				ex, err := client.Do(ctx, extproctest.Request{Path: body.Path, Body: body.Unique(run, n), Response: resp})
				if err != nil || ex.Immediate != nil || ex.Destination == "" {
					b.Fatalf("err=%v immediate=%+v", err, ex.Immediate)
				}
				return ex.RoutingLatency
			}
			do(0) // the conversation's history is seen once before (a continuing conversation)
			lat := make([]time.Duration, 0, 1024)
			b.ReportAllocs()
			b.ResetTimer()
			cpu0 := processCPU()
			for i := 0; i < b.N; i++ {
				lat = append(lat, do(uint64(i+1)))
			}
			cpu := processCPU() - cpu0
			b.StopTimer()
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "decision-p50-µs")
			b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/op")
		})
	}
}

// processCPU returns this process's user+system CPU time.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
