package kvindex

import (
	"math/rand/v2"
	"slices"
)

// This file holds test helpers: event builders, a naive reference index written straight from
// the spec text (maps everywhere, no slots or bitsets), and a random event generator.

// cand is shorthand for a candidate.
func cand(w uint64, r uint32) Candidate { return Candidate{WorkerID: w, DPRank: r} }

// blk builds StoredBlocks from (external hash, tokens hash) pairs.
func blk(pairs ...uint64) []StoredBlock {
	out := make([]StoredBlock, 0, len(pairs)/2)
	for i := 0; i+1 < len(pairs); i += 2 {
		out = append(out, StoredBlock{BlockHash: pairs[i], TokensHash: pairs[i+1]})
	}
	return out
}

// store builds a Stored event from the root (parent nil) or below parent.
func store(c Candidate, t Tier, parent *uint64, blocks []StoredBlock) Event {
	ev := Event{WorkerID: c.WorkerID, DPRank: c.DPRank, Tier: t, Kind: EventStored, Blocks: blocks}
	if parent != nil {
		ev.HasParent, ev.ParentHash = true, *parent
	}
	return ev
}

func removed(c Candidate, t Tier, hashes ...uint64) Event {
	return Event{WorkerID: c.WorkerID, DPRank: c.DPRank, Tier: t, Kind: EventRemoved, BlockHashes: hashes}
}

func cleared(c Candidate) Event {
	return Event{WorkerID: c.WorkerID, DPRank: c.DPRank, Kind: EventCleared}
}

func p(v uint64) *uint64 { return &v }

// chainBlocks returns blocks whose tokens hashes are toks and external hashes are base+toks[i]
// (a per-worker external id scheme that never collides with tokens hashes in tests).
func chainBlocks(base uint64, toks ...uint64) []StoredBlock {
	out := make([]StoredBlock, len(toks))
	for i, t := range toks {
		out[i] = StoredBlock{BlockHash: base + t, TokensHash: t}
	}
	return out
}

// sortMatches orders matches by candidate for comparison.
func sortMatches(m []Match) []Match {
	slices.SortFunc(m, func(a, b Match) int { return cmpCandidate(a.Candidate, b.Candidate) })
	return m
}

// ---- reference model ----

type mnode struct {
	key      uint64
	parent   *mnode
	children map[uint64]*mnode
	workers  map[Candidate]uint64
}

type medge struct {
	parent uint64
	root   bool
	tok    uint64
}

type model struct {
	root   *mnode
	lookup map[Candidate]map[uint64]*mnode
	lower  [numTiers]map[Candidate]map[medge]uint64 // index 0 unused
}

func newModel() *model {
	m := &model{root: &mnode{children: map[uint64]*mnode{}, workers: map[Candidate]uint64{}}, lookup: map[Candidate]map[uint64]*mnode{}}
	for t := 1; t < numTiers; t++ {
		m.lower[t] = map[Candidate]map[medge]uint64{}
	}
	return m
}

// drop removes c from n and unlinks n and its ancestors while they are empty and childless.
func (m *model) drop(n *mnode, c Candidate) {
	delete(n.workers, c)
	for n != m.root && len(n.workers) == 0 && len(n.children) == 0 {
		delete(n.parent.children, n.key)
		n = n.parent
	}
}

func (m *model) known(c Candidate, h uint64) bool {
	if _, ok := m.lookup[c][h]; ok {
		return true
	}
	for t := 1; t < numTiers; t++ {
		for _, x := range m.lower[t][c] {
			if x == h {
				return true
			}
		}
	}
	return false
}

func (m *model) apply(ev Event) {
	c := ev.Candidate()
	switch ev.Kind {
	case EventStored:
		seen := map[uint64]bool{}
		for _, b := range ev.Blocks {
			if seen[b.BlockHash] || (ev.HasParent && b.BlockHash == ev.ParentHash) {
				return
			}
			seen[b.BlockHash] = true
		}
		if ev.Tier == TierDevice {
			cur := m.root
			if ev.HasParent {
				n, ok := m.lookup[c][ev.ParentHash]
				if !ok {
					return
				}
				cur = n
			}
			for _, b := range ev.Blocks {
				n := cur.children[b.TokensHash]
				if n == nil {
					n = &mnode{key: b.TokensHash, parent: cur, children: map[uint64]*mnode{}, workers: map[Candidate]uint64{}}
					cur.children[b.TokensHash] = n
				}
				if m.lookup[c] == nil {
					m.lookup[c] = map[uint64]*mnode{}
				}
				old, had := m.lookup[c][b.BlockHash]
				if oldExt, ok := n.workers[c]; ok && oldExt != b.BlockHash {
					delete(m.lookup[c], oldExt)
				}
				n.workers[c] = b.BlockHash
				m.lookup[c][b.BlockHash] = n
				if had && old != n {
					m.drop(old, c)
				}
				cur = n
			}
			return
		}
		if ev.HasParent && !m.known(c, ev.ParentHash) {
			return
		}
		if m.lower[ev.Tier][c] == nil {
			m.lower[ev.Tier][c] = map[medge]uint64{}
		}
		edges := m.lower[ev.Tier][c]
		k := medge{parent: ev.ParentHash, root: !ev.HasParent}
		for _, b := range ev.Blocks {
			k.tok = b.TokensHash
			for k2, x := range edges {
				if x == b.BlockHash && k2 != k {
					delete(edges, k2)
				}
			}
			edges[k] = b.BlockHash
			k = medge{parent: b.BlockHash}
		}
	case EventRemoved:
		if ev.Tier == TierDevice {
			for _, h := range ev.BlockHashes {
				if n, ok := m.lookup[c][h]; ok {
					delete(m.lookup[c], h)
					m.drop(n, c)
				}
			}
			return
		}
		for _, h := range ev.BlockHashes {
			for k, x := range m.lower[ev.Tier][c] {
				if x == h {
					delete(m.lower[ev.Tier][c], k)
				}
			}
		}
	case EventCleared:
		m.clear(c)
	}
}

func (m *model) clear(c Candidate) {
	for _, n := range m.lookup[c] {
		m.drop(n, c)
	}
	delete(m.lookup, c)
	for t := 1; t < numTiers; t++ {
		delete(m.lower[t], c)
	}
}

func (m *model) removeWorker(w uint64) {
	var cs []Candidate
	for c := range m.lookup {
		cs = append(cs, c)
	}
	for t := 1; t < numTiers; t++ {
		for c := range m.lower[t] {
			cs = append(cs, c)
		}
	}
	for _, c := range cs {
		if c.WorkerID == w {
			m.clear(c)
		}
	}
}

func (m *model) entries() uint64 {
	var n uint64
	for _, l := range m.lookup {
		n += uint64(len(l))
	}
	return n
}

func (m *model) findMatches(local []uint64) []Match {
	depth := map[Candidate]int{}
	ext := map[Candidate]uint64{}
	cur := m.root
	var active map[Candidate]bool
	for d, h := range local {
		n := cur.children[h]
		if n == nil {
			break
		}
		next := map[Candidate]bool{}
		for c, x := range n.workers {
			if d == 0 || active[c] {
				next[c] = true
				depth[c] = d + 1
				ext[c] = x
			}
		}
		active = next
		if len(active) == 0 {
			break
		}
		cur = n
	}
	all := map[Candidate]bool{}
	for c := range depth {
		all[c] = true
	}
	for t := 1; t < numTiers; t++ {
		for c, e := range m.lower[t] {
			if len(e) > 0 {
				all[c] = true
			}
		}
	}
	var out []Match
	for c := range all {
		mt := Match{Candidate: c, Device: uint32(depth[c])}
		d := depth[c]
		cursor, root := ext[c], d == 0
		for t := 1; t < numTiers; t++ {
			steps := uint32(0)
			for d < len(local) {
				x, ok := m.lower[t][c][medge{parent: cursor, root: root, tok: local[d]}]
				if !ok {
					break
				}
				cursor, root = x, false
				d++
				steps++
			}
			switch Tier(t) {
			case TierHostPinned:
				mt.HostExt = steps
			case TierDisk:
				mt.DiskExt = steps
			case TierExternal:
				mt.ExternalExt = steps
			}
		}
		if mt.Blocks() > 0 {
			out = append(out, mt)
		}
	}
	return sortMatches(out)
}

// ---- random event streams ----

// genConfig bounds a random event stream: small universes make collisions, shared prefixes,
// overwrites and orphans common.
type genConfig struct {
	workers, ranks int
	toks           int  // tokens-hash universe
	exts           int  // external-hash universe per candidate
	lowerTiers     bool // emit host/disk/external events too
}

// genEvents returns n random events for candidates of cfg.
func genEvents(r *rand.Rand, cfg genConfig, n int) []Event {
	evs := make([]Event, 0, n)
	for i := 0; i < n; i++ {
		c := cand(uint64(r.IntN(cfg.workers)+1), uint32(r.IntN(cfg.ranks)))
		t := TierDevice
		if cfg.lowerTiers && r.IntN(3) == 0 {
			t = Tier(1 + r.IntN(numTiers-1))
		}
		extBase := c.WorkerID * 1000
		switch k := r.IntN(20); {
		case k < 13:
			nb := 1 + r.IntN(6)
			blocks := make([]StoredBlock, nb)
			for j := range blocks {
				blocks[j] = StoredBlock{BlockHash: extBase + uint64(r.IntN(cfg.exts)), TokensHash: uint64(r.IntN(cfg.toks))}
			}
			var parent *uint64
			if r.IntN(2) == 0 {
				parent = p(extBase + uint64(r.IntN(cfg.exts)))
			}
			evs = append(evs, store(c, t, parent, blocks))
		case k < 18:
			nh := 1 + r.IntN(3)
			hs := make([]uint64, nh)
			for j := range hs {
				hs[j] = extBase + uint64(r.IntN(cfg.exts))
			}
			evs = append(evs, removed(c, t, hs...))
		default:
			evs = append(evs, cleared(c))
		}
		evs[len(evs)-1].EventID = uint64(i)
	}
	return evs
}

// genPrompts returns random queries: paths that exist in the index's tree (so that deep matches
// are exercised) and random token-hash sequences.
func genPrompts(r *rand.Rand, ix *Index, toks, n int) [][]uint64 {
	var out [][]uint64
	for i := 0; i < n; i++ {
		var q []uint64
		for len(q) < 12 {
			kids := childKeys(ix, q)
			if len(kids) == 0 || r.IntN(8) == 0 {
				break
			}
			q = append(q, kids[r.IntN(len(kids))])
		}
		for r.IntN(3) != 0 {
			q = append(q, uint64(r.IntN(toks)))
		}
		out = append(out, q)
	}
	return out
}
