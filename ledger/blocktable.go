package ledger

// blockRef is the per-sequence-hash state on one candidate: how many live holdings reference the
// hash, and the XOR of the holders' slot indices. When count == 1 the XOR is exactly the sole
// holder's slot, which is all the decay weighting of selection-service.md §10.3 needs to know.
type blockRef struct {
	count uint32
	xor   uint32
}

// blockTable is an open-addressing (linear probing, backward-shift deletion) hash table from a
// sequence hash to its blockRef. Sequence hashes are well mixed already; a Fibonacci multiply
// spreads caller-chosen hash-form values too. A zero count marks an empty slot, so every hash
// value including 0 is a valid key. No tombstones: deletions keep probe chains short forever.
type blockTable struct {
	keys  []uint64
	vals  []blockRef
	n     int // occupied slots (= distinct live hashes)
	shift uint
}

const (
	minTableSize  = 16
	shrinkMinSize = 8192
	fibMul        = 0x9E3779B97F4A7C15
)

func (t *blockTable) home(k uint64) int { return int((k * fibMul) >> t.shift) }

func (t *blockTable) init(size int) {
	t.keys = make([]uint64, size)
	t.vals = make([]blockRef, size)
	t.n = 0
	bits := uint(0)
	for 1<<bits < size {
		bits++
	}
	t.shift = 64 - bits
}

// find returns the slot holding k and true, or the empty slot where k would be inserted and false.
// The table must be initialised.
func (t *blockTable) find(k uint64) (int, bool) {
	mask := len(t.keys) - 1
	i := t.home(k)
	for {
		if t.vals[i].count == 0 {
			return i, false
		}
		if t.keys[i] == k {
			return i, true
		}
		i = (i + 1) & mask
	}
}

// contains reports whether k is live in the table.
func (t *blockTable) contains(k uint64) bool {
	if t.n == 0 {
		return false
	}
	_, ok := t.find(k)
	return ok
}

// slotFor returns the slot of k, inserting an empty (count 0) entry for k if needed; the caller
// must then set a non-zero count. Grows the table to keep the load factor at most 3/4.
func (t *blockTable) slotFor(k uint64) (int, bool) {
	if t.keys == nil {
		t.init(minTableSize)
	}
	i, ok := t.find(k)
	if ok {
		return i, true
	}
	if (t.n+1)*4 > len(t.keys)*3 {
		t.resize(len(t.keys) * 2)
		i, _ = t.find(k)
	}
	t.keys[i] = k
	t.n++
	return i, false
}

func (t *blockTable) resize(size int) {
	oldK, oldV := t.keys, t.vals
	t.init(size)
	mask := size - 1
	for j, v := range oldV {
		if v.count == 0 {
			continue
		}
		k := oldK[j]
		i := t.home(k)
		for t.vals[i].count != 0 {
			i = (i + 1) & mask
		}
		t.keys[i], t.vals[i] = k, v
		t.n++
	}
}

// deleteAt empties slot i (which must be occupied) and backward-shifts the rest of its probe
// chain so that lookups never need tombstones. Shrinks the table when it becomes sparse.
func (t *blockTable) deleteAt(i int) {
	mask := len(t.keys) - 1
	for {
		t.vals[i] = blockRef{}
		j := i
		for {
			j = (j + 1) & mask
			if t.vals[j].count == 0 {
				t.n--
				t.maybeShrink()
				return
			}
			dist := (j - t.home(t.keys[j])) & mask // how far j is from its home slot
			if dist >= (j-i)&mask {
				break // j may move back to i without passing its home
			}
		}
		t.keys[i], t.vals[i] = t.keys[j], t.vals[j]
		i = j
	}
}

// maybeShrink halves a large table that has become very sparse (≤ 1/32 full). Small tables never
// shrink, so a rank that repeatedly books and frees ordinary prompts never reallocates.
func (t *blockTable) maybeShrink() {
	if len(t.keys) > shrinkMinSize && t.n*32 < len(t.keys) {
		t.resize(len(t.keys) / 2)
	}
}
