package extproc

import (
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/uuid"

	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/picker"
)

// rankAddress returns the "host:port" Envoy sends a rank to: the host:port of the endpoint the
// catalog names for it (picker.Selection.Endpoint is already the rank's endpoint: a discovered
// pod serves rank r on its targetPorts[r], epp.md §5.6 step 6, §10.3), so ext_proc and the
// selection API always name the same destination.
func (s *Server) rankAddress(endpoint string) (string, error) {
	return s.rankAddrs.get(endpoint, endpointHostPort)
}

// servedRank resolves the endpoint a gateway reports as served ("ip:port") to a worker rank of
// the booking's partition by matching each rank's endpoint in the catalog
// (picker.WorkerRecord.RankEndpoint); ranks sharing one endpoint resolve to the worker's first
// rank. ok is false for unknown endpoints.
func (st *stream) servedRank(served string) (picker.WorkerRank, bool) {
	want := normalizeEndpoint(served)
	for _, w := range st.s.cfg.Picker.Workers(st.booked.ModelName, st.booked.RoutingGroup) {
		start, size := uint32(0), uint32(1)
		if w.DataParallelStartRank != nil {
			start = *w.DataParallelStartRank
		}
		if w.DataParallelSize != nil {
			size = *w.DataParallelSize
		}
		for r := start; uint64(r) < uint64(start)+uint64(size); r++ {
			hp, err := endpointHostPort(w.RankEndpoint(r))
			if err == nil && normalizeEndpoint(hp) == want {
				return picker.WorkerRank{WorkerID: w.WorkerID, DPRank: r}, true
			}
			if len(w.RankEndpoints) == 0 {
				break // every rank shares the endpoint
			}
		}
	}
	return picker.WorkerRank{}, false
}

// moveBooking implements epp.md §6.3 when the gateway served the request from another endpoint
// than the primary (a fallback, or its own retry): the stream's booking moves to the served rank —
// an explicit reservation with the same tracked hashes and isl_tokens (prefill = isl_tokens when
// prefill is tracked) is booked there, prefill completion is carried over, and only then is the
// primary freed, so the load is never counted on both ranks for longer than the swap and never
// lost. It returns false, leaving the booking on the primary, for load-only picks, a booking
// already freed, an endpoint that is not a known rank of the partition, the primary rank itself,
// or a failed reservation.
func (st *stream) moveBooking(served string) bool {
	prev := st.bk.state.Load()
	if prev != bookingLive && prev != bookingPrefilled {
		return false
	}
	to, ok := st.servedRank(served)
	if !ok || (to.WorkerID == st.booked.WorkerID && to.DPRank == st.booked.DPRank) {
		return false
	}
	seq := st.booked.SequenceHashes
	if seq == nil {
		seq = []uint64{}
	}
	track := st.booked.TrackPrefillTokens
	newID := uuid.NewString()
	ctx, cancel := st.s.releaseCtx(st.ctx)
	defer cancel()
	wid, rank := to.WorkerID, to.DPRank
	_, err := st.s.cfg.Picker.Reserve(ctx, picker.ReservationRequest{
		ModelName: st.booked.ModelName, RoutingGroup: st.booked.RoutingGroup, SelectionID: newID,
		WorkerID: &wid, DPRank: &rank,
		Prompt:             picker.Prompt{HashForm: true, SequenceHashes: seq, ISLTokens: st.booked.ISLTokens, ISLTokensSet: true},
		TrackPrefillTokens: &track,
	})
	if err != nil {
		st.s.log.Warn().Err(err).Str("request_id", excerpt.Of(st.requestID())).Uint64("worker_id", wid).Uint32("dp_rank", rank).
			Msg("could not move the booking to the served endpoint; it stays on the primary")
		return false
	}
	if prev == bookingPrefilled {
		if err := st.s.cfg.Picker.PrefillComplete(ctx, newID); err != nil {
			st.s.log.Debug().Err(err).Str("selection_id", newID).Msg("prefill_complete of the moved booking failed")
		}
	}
	old := st.bk.id
	st.bk.id = newID // the stream owns the new booking; its state (live or prefilled) carries over
	if err := st.s.cfg.Picker.Free(ctx, old); err != nil {
		st.s.log.Debug().Err(err).Str("selection_id", old).Msg("free of the moved-from booking failed")
	}
	st.booked.WorkerID, st.booked.DPRank = wid, rank
	st.s.metrics.servedEndpointMoves.Add(1)
	return true
}

// Conformance-suite hooks of the Gateway API Inference Extension (its lwepp reference picker's
// behaviour), active only with Config.ConformanceTestHooks.
const (
	// TestEndpointSelectionHeader restricts a request's candidates to the listed pods: a
	// comma-separated list of "ip" or "ip:port" entries, matched by IP.
	TestEndpointSelectionHeader = "test-epp-endpoint-selection"
	// ConformanceServedHeader reports on the response the endpoint the gateway says served it
	// (envoy.lb x-gateway-destination-endpoint-served), or why it could not.
	ConformanceServedHeader = "x-conformance-test-served-endpoint"
	// ConformanceSelectedHeader reports on the response the endpoint the picker selected.
	ConformanceSelectedHeader = "x-conformance-test-selected-endpoint"
	// ConformancePoolHeader reports on the response the InferencePool ("namespace/name").
	ConformancePoolHeader = "x-conformance-test-epp-pool"
	// conformanceNoLBMetadata and conformanceNoServed are the served header's values when the
	// gateway sent no envoy.lb metadata, or no served key in it: the suite then fails the check.
	conformanceNoLBMetadata = "fail: missing envoy lb metadata"
	conformanceNoServed     = "fail: missing destination endpoint served metadata"
)

// testSelectionAllowed narrows the candidates to the pods named by the test-epp-endpoint-selection
// header (matched by IP, ports ignored), intersected with the subset hint's ids when one was
// given. Nothing left → 503.
func (st *stream) testSelectionAllowed(model string, hinted []uint64, hintSet bool) ([]uint64, bool, error) {
	var hosts []string
	for _, e := range strings.Split(st.hdr.testSelection, ",") {
		if h := hintHost(e); h != "" {
			hosts = append(hosts, h)
		}
	}
	ids := allowedWorkers(hosts, st.s.cfg.Picker.Workers(model, st.s.group))
	if hintSet {
		in := make(map[uint64]bool, len(hinted))
		for _, id := range hinted {
			in[id] = true
		}
		kept := ids[:0]
		for _, id := range ids {
			if in[id] {
				kept = append(kept, id)
			}
		}
		ids = kept
	}
	if len(ids) == 0 {
		return nil, true, picker.Errorf(picker.KindNotReady, "the %s header leaves no candidate worker", TestEndpointSelectionHeader)
	}
	return ids, true, nil
}

// conformanceResponseHeaders is the response headers mutation of the conformance hooks: the
// served endpoint from the response-headers message's envoy.lb metadata (or the suite's failure
// text), the selected primary and the pool.
func (st *stream) conformanceResponseHeaders() *extprocv3.HeaderMutation {
	served := conformanceNoLBMetadata
	switch {
	case st.servedKey:
		served = st.servedValue
	case st.lbSeen:
		served = conformanceNoServed
	}
	set := []*corev3.HeaderValueOption{setHeader(ConformanceServedHeader, served)}
	if st.primary != "" {
		set = append(set, setHeader(ConformanceSelectedHeader, st.primary))
	}
	if st.s.cfg.PoolName != "" {
		set = append(set, setHeader(ConformancePoolHeader, st.s.cfg.PoolName))
	}
	return &extprocv3.HeaderMutation{SetHeaders: set}
}

// noteConformanceMetadata records the envoy.lb served-endpoint metadata of a response-headers
// message for the conformance served header.
func (st *stream) noteConformanceMetadata(req *extprocv3.ProcessingRequest) {
	ns, ok := req.GetMetadataContext().GetFilterMetadata()[LBMetadataNamespace]
	st.lbSeen = ok && ns != nil
	v, ok := ns.GetFields()[ServedEndpointKey]
	st.servedKey = ok
	st.servedValue = strings.TrimSpace(v.GetStringValue())
}
