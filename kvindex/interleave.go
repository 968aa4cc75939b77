package kvindex

import (
	"math/bits"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
)

// Lookups during long writes (kv-events-index.md §16: queries run concurrently with event
// application and observe a consistent per-node state).
//
// A write holds its shard's write lock, and a lookup reaching that shard waits for it. Two
// things keep that wait short:
//
//   - Yields. A long write stops at points where the shard is consistent — between blocks of a
//     store, between stretches of a removal, between pieces of a clear — and, when lookups wait
//     for the shard (shard.waiting), releases the lock so they run, then takes it again.
//     A lookup then sees the event partly applied, as if it had been split into shorter events:
//     every block it sees is in a state of the event stream, never torn. While a write of a
//     worker is paused, that worker's other writes wait (shard.busy), so the events of one
//     worker still apply one at a time and in order, whatever goroutines they come from.
//   - Clears that take effect at once. Cleared and RemoveWorker kill the candidate's slot under
//     the lock in constant time: it leaves the shard's maps and counters, and lookups ignore it
//     (shard.dead). Its entries are removed afterwards (bury), with yields; the slot number is
//     not reused until then. A lookup never sees a clear partly applied.
//
// Approx shards do not yield: their expiry bookkeeping follows every entry change under the
// lock.

// writeOp names the write holding a shard's lock: its worker and a per-shard sequence number.
type writeOp struct {
	worker, op uint64
}

// interleaving is the part of a shard that lets lookups in during long writes.
type interleaving struct {
	interleave bool         // writes yield to waiting lookups (Index shards, not Approx)
	waiting    atomic.Int32 // lookups waiting for the lock
	closing    atomic.Bool  // a writer is taking the lock back: lookups that do not wait yet hold off
	writer     writeOp      // the write holding the lock
	ops        uint64       // writes begun, for writeOp.op
	// busy maps a worker to its write paused at a yield; the worker's other writes wait on
	// idle (whose Locker is the shard's write lock) until it ends.
	busy        map[uint64]uint64
	idle        *sync.Cond
	idleWaiters int
	// pendingDevice counts the device entries of dead slots not yet removed; Stats leaves
	// them out, as the clears that killed the slots are complete.
	pendingDevice uint64
	// yieldHook, a test hook, makes every yield point yield and runs with the lock released.
	yieldHook func()
}

// tryRLock read-locks the shard if it is free and no writer is taking it back.
func (sh *shard) tryRLock() bool { return !sh.closing.Load() && sh.mu.TryRLock() }

// rlock read-locks the shard, first telling a long write in progress that a lookup waits.
//
// A lookup that finds the shard written spins for a while rather than sleeping on the lock:
// the writer lets it in at its next yield point, microseconds away, and a sleeping lookup would
// cost a wake-up, often on another core, every time. Only a writer that does not reach a yield
// point for a long time puts it to sleep.
func (sh *shard) rlock() {
	if sh.tryRLock() {
		return
	}
	sh.waiting.Add(1)
	for i, n := 1, spins(); i <= n; i++ {
		if sh.tryRLock() {
			sh.waiting.Add(-1)
			return
		}
		spin(i)
	}
	sh.mu.RLock()
	sh.waiting.Add(-1)
}

// spins returns handSpins when waiting by spinning can pay — the process runs more than one
// thread and no more than the machine has cores (with one, the spinning thread is the one the
// other waits for; with more than cores, it takes a core from it) — and 0 otherwise.
func spins() int {
	if n := runtime.GOMAXPROCS(0); n == 1 || n > runtime.NumCPU() {
		return 0
	}
	return handSpins
}

// handSpins bounds the tries of the lock (a few nanoseconds each; a microsecond or two in all,
// about the work between yield points) that a lookup spends waiting for a yield point, and a
// writer spends handing the lock over and back, before sleeping on the lock instead.
const handSpins = 256

// spin is the pause between tries number i: every 32nd lets other goroutines run (with one
// thread, the one holding the lock).
func spin(i int) {
	if i%32 == 0 {
		runtime.Gosched()
	}
}

// beginWrite records the write of workerID that now holds the lock.
func (sh *shard) beginWrite(workerID uint64) {
	sh.ops++
	sh.writer = writeOp{worker: workerID, op: sh.ops}
}

// endWrite ends the write holding the lock: its worker is no longer busy.
func (sh *shard) endWrite() {
	w := sh.writer
	if op, ok := sh.busy[w.worker]; ok && op == w.op {
		delete(sh.busy, w.worker)
		if sh.idleWaiters > 0 {
			sh.idle.Broadcast()
		}
	}
	sh.writer = writeOp{}
}

// waitIdle waits, lock held, until no write of workerID is paused (the lock is released while
// it waits). It reports whether it waited, in which case the caller checks its assumptions
// about the shard again.
func (sh *shard) waitIdle(workerID uint64) bool {
	if _, ok := sh.busy[workerID]; !ok {
		return false
	}
	for {
		sh.idleWaiters++
		sh.idle.Wait()
		sh.idleWaiters--
		if _, ok := sh.busy[workerID]; !ok {
			return true
		}
	}
}

// yield is a yield point of a write of one candidate (see above): it lets waiting lookups in,
// keeping the write's worker busy. The caller holds no pointer into the shard across it.
func (sh *shard) yield() { sh.pause(true) }

// pause releases and retakes the lock when lookups wait (always with yieldHook set); mark
// keeps the writer's worker busy meanwhile. Yield points are a few microseconds of work apart
// (yieldBlocks, deadPiece), so a lookup waits about that long; each hand-over costs the
// writer about a microsecond.
func (sh *shard) pause(mark bool) {
	if !sh.interleave || sh.yieldHook == nil && sh.waiting.Load() == 0 {
		return
	}
	me := sh.writer
	if mark {
		if sh.busy == nil {
			sh.busy = make(map[uint64]uint64)
		}
		sh.busy[me.worker] = me.op
	}
	sh.mu.Unlock()
	if sh.yieldHook != nil {
		sh.yieldHook()
	}
	// Hand over: wait until the waiting lookups hold the read lock, hold off the others, and
	// take the lock back as soon as the ones in are done, spinning rather than sleeping (see
	// rlock).
	n := spins()
	if n == 0 {
		sh.mu.Lock() // the lookups woken by Unlock go first
		sh.writer = me
		return
	}
	for i := 1; i <= n && sh.waiting.Load() > 0; i++ {
		spin(i)
	}
	sh.closing.Store(true)
	for i := 1; !sh.mu.TryLock(); i++ {
		if i == n {
			sh.mu.Lock()
			break
		}
		spin(i)
	}
	sh.closing.Store(false)
	sh.writer = me
}

// isDead reports whether slot s was cleared and is awaiting burial.
func (sh *shard) isDead(s uint32) bool {
	return sh.ndead > 0 && int(s>>6) < len(sh.dead) && sh.dead[s>>6]&(1<<(s&63)) != 0
}

// deadSlot is a killed slot's detached lookup and lower stores, which only bury reads.
type deadSlot struct {
	s      uint32
	ext    extIndex
	idBits uint8 // the id width of ext's entries when detached
	lower  [numTiers - 1]*lowerStore
}

// clear removes slot s from every tier (§11.4): at once for everyone, its entries then buried
// with yields; in a shard that does not yield, all at once.
func (sh *shard) clear(s uint32) {
	if !sh.interleave {
		sh.clearSlot(s)
		return
	}
	sh.bury(sh.kill(s))
}

// kill clears slot s for every lookup and write in constant time (plus its lower stores'
// counts): the candidate leaves slotOf, the counters and its worker's assignment, its lookup
// and lower stores are detached, and lookups skip the slot until bury frees it.
func (sh *shard) kill(s uint32) deadSlot {
	st := &sh.slots[s]
	d := deadSlot{s: s, ext: st.ext, idBits: sh.idBits, lower: st.lower}
	sh.pendingDevice += uint64(st.ext.count)
	for t, ls := range st.lower {
		if ls != nil {
			sh.st.TierEntries[t+1] -= uint64(len(ls.rev))
		}
	}
	st.ext, st.lower = extIndex{}, [numTiers - 1]*lowerStore{}
	sh.syncLower(s)
	for len(sh.dead) <= int(s>>6) {
		sh.dead = append(sh.dead, 0)
	}
	sh.dead[s>>6] |= 1 << (s & 63)
	sh.ndead++
	delete(sh.slotOf, st.cand)
	sh.st.Candidates--
	sh.leaveWorker(st.cand.WorkerID)
	return d
}

// deadPiece bounds the blocks a burial removes between yields (a few microseconds of work).
const deadPiece = 64

// bury removes dead slot d's entries from the tree and the lower tiers' root index, then frees
// the slot. The write lock is held on entry and on return; it is released while d's entries
// are gathered and sorted (they belong to d alone), and between pieces when lookups wait.
func (sh *shard) bury(d deadSlot) {
	me := sh.writer
	sh.mu.Unlock()
	ids := make([]uint32, 0, d.ext.count)
	mask := uint32(1)<<d.idBits - 1
	d.ext.forEachBucket(func(b *extBucket) {
		for i := 0; i < b.size(); i++ {
			ids = append(ids, b.id(i)&mask)
		}
	})
	sortBlockIDs(ids)
	var roots []uint64 // tokens_hash of each root edge (lowerRefs counts edges)
	for _, ls := range d.lower {
		if ls != nil {
			for k := range ls.edges {
				if k.root {
					roots = append(roots, k.tok)
				}
			}
		}
	}
	sh.mu.Lock()
	sh.writer = me
	sh.dropDead(d.s, ids)
	for i, tok := range roots {
		sh.unrefRoot(edgeKey{tok: tok, root: true}, d.s)
		if i%deadPiece == deadPiece-1 {
			sh.pause(false)
		}
	}
	sh.dead[d.s>>6] &^= 1 << (d.s & 63)
	sh.ndead--
	sh.freeSlot(d.s)
}

// sortBlockIDs sorts distinct block ids: large sets by chunk (a counting pass) and then by
// offset within each chunk (a bitset), in linear time.
func sortBlockIDs(ids []uint32) {
	if len(ids) < 4096 {
		slices.Sort(ids)
		return
	}
	chunks := 0
	for _, id := range ids {
		chunks = max(chunks, int(id>>chunkBits)+1)
	}
	start := make([]int, chunks+1) // start[c]: where chunk c's ids begin in out
	for _, id := range ids {
		start[id>>chunkBits+1]++
	}
	for c := 1; c <= chunks; c++ {
		start[c] += start[c-1]
	}
	out := make([]uint32, len(ids))
	next := slices.Clone(start[:chunks])
	for _, id := range ids {
		c := id >> chunkBits
		out[next[c]] = id
		next[c]++
	}
	var set [chunkSize / 64]uint64
	for c := 0; c < chunks; c++ {
		seg := out[start[c]:start[c+1]]
		for _, id := range seg {
			set[id&chunkMask>>6] |= 1 << (id & 63)
		}
		k := 0
		for w := range set {
			for v := set[w]; v != 0; v &= v - 1 {
				seg[k] = uint32(c)<<chunkBits | uint32(w)<<6 | uint32(bits.TrailingZeros64(v))
				k++
			}
			set[w] = 0
		}
	}
	copy(ids, out)
}

// dropDead removes dead slot s from blocks ids (sorted), deepest-numbered first so that each
// piece is pruned as it empties, at most deadPiece blocks of one run at a time.
func (sh *shard) dropDead(s uint32, ids []uint32) {
	for hi := len(ids); hi > 0; {
		x := ids[hi-1]
		ci, ri := sh.locate(x)
		start := sh.chunks[ci].runs[ri].off
		o := uint16(x & chunkMask)
		L := 1
		for L < deadPiece && hi-L > 0 && ids[hi-L-1] == x-uint32(L) && o >= start+uint16(L) {
			L++
		}
		ri = sh.isolate(ci, ri, o+1-uint16(L), L)
		sh.removeHolder(ci, ri, s)
		sh.st.TierEntries[TierDevice] -= uint64(L)
		sh.pendingDevice -= uint64(L)
		if sh.chunks[ci].runs[ri].holder == noHolder {
			sh.prune(x)
		} else {
			sh.mergeAround(ci, ri)
		}
		hi -= L
		sh.pause(false)
	}
}
