package discovery

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/picker"
)

// CandidateSetter is the optional part of a Catalog that separates registered workers from
// candidates (epp.md §10.2). *picker.Service implements it; a Catalog without it treats every
// registered worker as a candidate.
type CandidateSetter interface {
	// SetCandidate records whether workerID may be picked; the mark may precede registration.
	SetCandidate(workerID uint64, candidate bool)
}

// desiredWorker is one worker a source wants in the catalog.
type desiredWorker struct {
	rec picker.WorkerRecord
	// incarnation names the process behind the record (a pod's UID, IP and container restart
	// counts). When it changes the worker is deleted and registered again, so its KV listeners,
	// sequence watermarks and cache view start fresh (epp.md §10.2, kv-events-index.md §13).
	// "" never triggers that.
	incarnation string
	// candidate is false for a worker that is registered but must not be picked (a pod whose
	// Ready condition is not True).
	candidate bool
}

// ownedWorker is what a reconciler last applied for a worker it registered.
type ownedWorker struct {
	rec         picker.WorkerRecord
	incarnation string
	candidate   bool
}

// applyResult counts the catalog operations of one apply.
type applyResult struct {
	upserts, deletes, reregistered, candidacy int
}

// reconciler applies full snapshots of one source to the catalog as diffs (epp.md §10.2,
// selection-service.md §4.2): it upserts new or changed records with source "discovery", deletes
// then re-registers workers whose incarnation changed, updates candidacy, and deletes the workers
// it registered that the snapshot no longer lists. Workers it did not register are never deleted
// (epp.md §11.3). Not safe for concurrent use: each source calls it from its one loop goroutine,
// which is what serializes the operations for one worker.
type reconciler struct {
	cat       Catalog
	cand      CandidateSetter // nil when cat has no candidacy
	log       zerolog.Logger
	opTimeout time.Duration
	// what names the source in log lines ("workers file", "InferencePool ns/name").
	what  string
	owned map[uint64]ownedWorker
}

func newReconciler(cat Catalog, log zerolog.Logger, opTimeout time.Duration, what string) *reconciler {
	cs, _ := cat.(CandidateSetter)
	return &reconciler{cat: cat, cand: cs, log: log, opTimeout: opTimeout, what: what, owned: map[uint64]ownedWorker{}}
}

// apply makes the catalog match want. Every operation is attempted; the joined errors are
// returned (the caller retries the whole snapshot). A worker whose operation failed keeps its
// previous owned state, so the retry repeats exactly what is still missing.
func (r *reconciler) apply(ctx context.Context, want []desiredWorker) (applyResult, error) {
	var res applyResult
	current := map[uint64]picker.WorkerState{}
	for _, st := range r.cat.Workers("", "") {
		current[st.WorkerID] = st
	}
	listed := make(map[uint64]bool, len(want))
	var errs []error
	for _, d := range want {
		id := d.rec.WorkerID
		listed[id] = true
		last, owned := r.owned[id]
		cur, present := current[id]
		if owned && present && last.incarnation != d.incarnation {
			// A new process behind the same worker id: start it from nothing.
			if err := r.delete(ctx, id); err != nil {
				errs = append(errs, fmt.Errorf("delete worker %d for re-registration: %w", id, err))
				continue
			}
			delete(r.owned, id)
			owned, present = false, false
			res.reregistered++
			r.log.Info().Uint64("worker_id", id).Str("source", r.what).
				Msg("worker deleted for re-registration: its pod was recreated, re-addressed or restarted")
		}
		if present && cur.Source == picker.SourceAPI && !owned {
			r.log.Warn().Uint64("worker_id", id).Str("source", r.what).
				Msg("worker id registered over the HTTP API is taken over by discovery")
		}
		if r.cand != nil && (!owned || !present || last.candidate != d.candidate) {
			// Before the upsert, so a worker that is not a candidate is never picked in between
			// (also when the worker left the catalog behind discovery's back: a DELETE over the
			// HTTP API clears the mark).
			r.cand.SetCandidate(id, d.candidate)
			if owned && last.candidate != d.candidate {
				res.candidacy++
			}
		}
		if owned && present && sameRecord(last.rec, d.rec) && sameRecord(cur.WorkerRecord, d.rec) {
			r.owned[id] = ownedWorker{rec: last.rec, incarnation: d.incarnation, candidate: d.candidate}
			continue
		}
		opCtx, cancel := context.WithTimeout(ctx, r.opTimeout)
		st, err := r.cat.UpsertWorker(opCtx, d.rec, picker.SourceDiscovery)
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("upsert worker %d: %w", id, err))
			if owned {
				// Keep the previous owned record (and candidacy), so the retry upserts again.
				last.candidate = d.candidate
				r.owned[id] = last
			} else if r.cand != nil {
				r.cand.SetCandidate(id, true) // not registered: leave no mark behind
			}
			continue
		}
		res.upserts++
		r.owned[id] = ownedWorker{rec: d.rec, incarnation: d.incarnation, candidate: d.candidate}
		ev := r.log.Info()
		msg := "worker registered"
		if len(st.NotSchedulableReasons) > 0 {
			// A worker the operator listed that cannot take traffic is worth a warning: the
			// reasons usually name a missing field or setting.
			ev = r.log.Warn().Strs("not_schedulable_reasons", st.NotSchedulableReasons)
			msg = "worker registered but not schedulable"
		}
		ev.Uint64("worker_id", id).Str("source", r.what).Str("lifecycle", st.Lifecycle).
			Str("endpoint", d.rec.Endpoint).Bool("candidate", d.candidate).Msg(msg)
	}
	gone := make([]uint64, 0)
	for id := range r.owned {
		if !listed[id] {
			gone = append(gone, id)
		}
	}
	sort.Slice(gone, func(i, j int) bool { return gone[i] < gone[j] })
	for _, id := range gone {
		if err := r.delete(ctx, id); err != nil {
			errs = append(errs, fmt.Errorf("delete worker %d: %w", id, err))
			continue
		}
		res.deletes++
		delete(r.owned, id)
		r.log.Info().Uint64("worker_id", id).Str("source", r.what).Msg("worker removed: no longer listed")
	}
	return res, errors.Join(errs...)
}

// delete removes a worker; one already gone counts as deleted. The candidacy mark goes with it.
func (r *reconciler) delete(ctx context.Context, id uint64) error {
	opCtx, cancel := context.WithTimeout(ctx, r.opTimeout)
	_, err := r.cat.DeleteWorker(opCtx, id)
	cancel()
	if err != nil && picker.KindOf(err) != picker.KindNotFound {
		return err
	}
	if r.cand != nil {
		r.cand.SetCandidate(id, true)
	}
	return nil
}

// retrier holds the snapshot whose apply failed and the timer of its retry: "a failed apply
// retries after 5 s unless a newer snapshot arrives first" (epp.md §10.2, selection-service.md
// §4.2). It lives inside one source's loop goroutine: the loop selects on C() and calls fire.
type retrier[S any] struct {
	interval time.Duration
	timer    *time.Timer
	pending  *S
}

func newRetrier[S any](interval time.Duration) *retrier[S] {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return &retrier[S]{interval: interval, timer: t}
}

// C fires when the pending snapshot is due for its retry.
func (r *retrier[S]) C() <-chan time.Time { return r.timer.C }

// failed schedules snap for a retry after the interval, replacing any older pending snapshot.
func (r *retrier[S]) failed(snap S) {
	r.pending = &snap
	r.timer.Reset(r.interval)
}

// succeeded drops any pending retry (a newer snapshot was applied).
func (r *retrier[S]) succeeded() {
	r.pending = nil
	r.timer.Stop()
}

// due returns the pending snapshot when the timer fired, and false when none is pending.
func (r *retrier[S]) due() (S, bool) {
	if r.pending == nil {
		var zero S
		return zero, false
	}
	s := *r.pending
	r.pending = nil
	return s, true
}

// isPending reports whether a failed snapshot waits for its retry.
func (r *retrier[S]) isPending() bool { return r.pending != nil }

// stop releases the timer.
func (r *retrier[S]) stop() { r.timer.Stop() }
