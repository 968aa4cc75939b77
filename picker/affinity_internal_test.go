package picker

import (
	"context"
	"testing"
	"time"
)

// The reservation-index sweep (§10.5) drops affinity leases whose booking was released out of
// band — here straight through the ledger, bypassing the service's lease release.
func TestSweepReservationsDropsLeasesOfVanishedBookings(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Router.UseKVEvents = false
	cfg.SessionAffinityTTL = time.Minute
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	bs := uint32(4)
	if _, err := s.UpsertWorker(context.Background(), WorkerRecord{WorkerID: 1, ModelName: "m", Endpoint: "http://w1:8000", BlockSize: &bs}, SourceAPI); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"kept", "vanished"} {
		if _, err := s.SelectAndReserve(context.Background(), SelectRequest{ModelName: "m", SelectionID: id,
			Prompt: Prompt{TokenIDs: []uint32{1, 2, 3, 4}}, Session: &SessionContext{SessionID: "s"}}); err != nil {
			t.Fatal(err)
		}
	}
	key := PartitionKey{ModelName: "m", RoutingGroup: "default"}
	if _, _, n, _ := s.SessionBinding(key, "s"); n != 2 {
		t.Fatalf("leases %d", n)
	}
	if _, err := s.ledger.Free("vanished"); err != nil {
		t.Fatal(err)
	}
	if n := s.SweepReservations(s.now()); n != 1 {
		t.Fatalf("sweep released %d leases, want 1", n)
	}
	if _, _, n, _ := s.SessionBinding(key, "s"); n != 1 {
		t.Fatalf("leases after the sweep %d, want 1", n)
	}
	if n := s.SweepReservations(s.now()); n != 0 {
		t.Fatalf("second sweep released %d", n)
	}
}
