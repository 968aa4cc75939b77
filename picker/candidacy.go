package picker

import (
	"maps"
	"slices"
)

// withheldSet is the immutable set of worker ids that are registered but not candidates; a
// selection reads the current set once (an atomic pointer load) and keeps it for the whole pass.
type withheldSet map[uint64]struct{}

// SetCandidate records whether workerID may be picked (epp.md §10.2 "registered vs candidate": a
// pod whose Ready condition is not True stays registered — its KV listeners, index rows and live
// bookings survive — but no selection, load-only pick, fallback or queue admission chooses it).
// Every worker is a candidate unless SetCandidate(id, false) was called; the mark is kept by id,
// independently of the catalog record, so a discovery source can withhold a worker before it is
// registered (no pick can land between its upsert and the mark). DeleteWorker clears the mark.
// Explicit reservations naming the worker (POST /reservations) are not picks and still book it.
// Never errors; safe for concurrent use.
func (s *Service) SetCandidate(workerID uint64, candidate bool) {
	s.withheldMu.Lock()
	cur := s.withheldLoad()
	if _, withheld := cur[workerID]; withheld == !candidate {
		s.withheldMu.Unlock()
		return
	}
	next := make(withheldSet, len(cur)+1)
	maps.Copy(next, cur)
	if candidate {
		delete(next, workerID)
	} else {
		next[workerID] = struct{}{}
	}
	s.withheld.Store(&next)
	s.withheldMu.Unlock()
	if candidate {
		// A worker back in the candidate set may let queued requests through (§13.3).
		for _, p := range s.partitionsSnapshot() {
			s.kick(p)
		}
	}
}

// IsCandidate reports whether workerID may be picked (see SetCandidate). Unknown ids are
// candidates.
func (s *Service) IsCandidate(workerID uint64) bool {
	_, withheld := s.withheldLoad()[workerID]
	return !withheld
}

// WithheldWorkers returns the ids marked not a candidate, ascending.
func (s *Service) WithheldWorkers() []uint64 {
	return slices.Sorted(maps.Keys(s.withheldLoad()))
}

// withheldLoad returns the current withheld set (nil when none was ever set).
func (s *Service) withheldLoad() withheldSet {
	if p := s.withheld.Load(); p != nil {
		return *p
	}
	return nil
}

// has reports whether id is in set (a nil or empty set withholds nothing).
func (set withheldSet) has(id uint64) bool {
	if len(set) == 0 {
		return false
	}
	_, ok := set[id]
	return ok
}
