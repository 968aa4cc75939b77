package runner

import (
	"testing"

	"github.com/google/uuid"
)

// TestUUIDsComeFromThePool: the process's UUIDv4s (x-request-id, selection ids) are drawn from
// google/uuid's randomness pool (runner's init), which makes one without allocating — read from
// crypto/rand per id, each allocates — and they are still distinct version-4 ids.
func TestUUIDsComeFromThePool(t *testing.T) {
	if n := testing.AllocsPerRun(100, func() { _, _ = uuid.NewRandom() }); n != 0 {
		t.Fatalf("%v allocations per UUID: the randomness pool is not enabled", n)
	}
	seen := map[uuid.UUID]bool{}
	for i := 0; i < 100; i++ {
		u, err := uuid.NewRandom()
		if err != nil || u.Version() != 4 || u.Variant() != uuid.RFC4122 || seen[u] {
			t.Fatalf("id %d: %v %v (version %d, variant %v, repeated %v)", i, u, err, u.Version(), u.Variant(), seen[u])
		}
		seen[u] = true
	}
}
