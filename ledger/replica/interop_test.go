package replica

import (
	"bufio"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/kvepp/kvepp/internal/pythontest"
	"github.com/kvepp/kvepp/ledger"
)

// TestInteropWithALibzmqPeer exchanges slot-tracker events with a peer built on libzmq and
// msgpack-python (testdata/libzmq_peer.py): its SUB subscribes to kvepp's PUB socket and decodes
// kvepp's payloads, and kvepp's SUB receives and decodes its admissions.
func TestInteropWithALibzmqPeer(t *testing.T) {
	pythontest.RequireZMQ(t)
	a := newManager(t, 1)
	fa := &fakeApplier{}
	if err := a.Start(fa); err != nil {
		t.Fatal(err)
	}
	_, stdout := pythontest.Start(t, "testdata/libzmq_peer.py", endpoint(a))
	lines := make(chan string, 64)
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	var hello struct{ Endpoint string }
	select {
	case line := <-lines:
		if err := json.Unmarshal([]byte(line), &hello); err != nil || hello.Endpoint == "" {
			t.Fatalf("peer said %q", line)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the libzmq peer did not start")
	}
	if _, err := a.RegisterPeer(hello.Endpoint); err != nil {
		t.Fatal(err)
	}

	// kvepp → libzmq: publish until the peer prints our admission.
	sent := ledger.SlotEvent{Kind: ledger.SlotAdmission, ID: "go-1", Candidate: ledger.Candidate{WorkerID: 5, DPRank: 1},
		SequenceHashes: []uint64{7, 1<<64 - 2}, TrackPrefillTokens: true, PrefillTokens: u64p(40), ExpectedOutputTokens: u32p(12)}
	var got struct {
		Topic string
		Msg   struct {
			ModelName    string `json:"model_name"`
			RoutingGroup string `json:"routing_group"`
			BlockSize    int    `json:"block_size"`
			Event        struct {
				RequestID string `json:"request_id"`
				Worker    struct {
					WorkerID uint64 `json:"worker_id"`
					DPRank   uint32 `json:"dp_rank"`
				} `json:"worker"`
				RouterID uint64 `json:"router_id"`
				Data     map[string]struct {
					TokenSequence   []uint64 `json:"token_sequence"`
					PrefillLoadHint struct {
						Tokens uint64 `json:"initial_effective_prefill_tokens"`
					} `json:"prefill_load_hint"`
				} `json:"data"`
			} `json:"event"`
		}
	}
	end := time.Now().Add(20 * time.Second)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for got.Msg.Event.RequestID != "go-1" {
		select {
		case line, ok := <-lines:
			if !ok {
				t.Fatal("the libzmq peer exited")
			}
			if err := json.Unmarshal([]byte(line), &got); err != nil {
				t.Fatalf("peer printed %q: %v", line, err)
			}
		case <-tick.C:
			a.PublishSlot(part, 16, sent)
		}
		if time.Now().After(end) {
			t.Fatal("the libzmq peer never received kvepp's admission")
		}
	}
	add := got.Msg.Event.Data["AddRequest"]
	if got.Topic != TopicSlotTracker || got.Msg.ModelName != part.ModelName || got.Msg.BlockSize != 16 || got.Msg.Event.RouterID != 1 ||
		got.Msg.Event.Worker.WorkerID != 5 || got.Msg.Event.Worker.DPRank != 1 ||
		fmt.Sprint(add.TokenSequence) != fmt.Sprint(sent.SequenceHashes) || add.PrefillLoadHint.Tokens != 40 {
		t.Fatalf("the libzmq peer decoded %+v", got)
	}

	// libzmq → kvepp: the peer's admission is decoded and applied.
	eventually(t, "the libzmq peer's admission", func() bool { return fa.has("py-1") })
	for _, ev := range fa.applied() {
		if ev.ID == "py-1" && (ev.Origin != 77 || ev.Candidate.WorkerID != 3 || *ev.PrefillTokens != 24 || *ev.ExpectedOutputTokens != 10 ||
			fmt.Sprint(ev.SequenceHashes) != fmt.Sprint([]uint64{1, 1<<64 - 1})) {
			t.Fatalf("applied %+v", ev)
		}
	}
}
