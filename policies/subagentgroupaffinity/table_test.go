package subagentgroupaffinity

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvepp/kvepp/policies"
)

// TestGroupTableMatchesAnLRUModel drives the table and a slice-based LRU model with the same
// random operations and compares every lookup and the final contents.
func TestGroupTableMatchesAnLRUModel(t *testing.T) {
	for _, limit := range []int{1, 2, 3, 8} {
		t.Run(fmt.Sprintf("a table of %d bindings behaves like an LRU map", limit), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(limit), 1))
			g := groupTable{limit: limit}
			var model []string // least recently used first
			bound := map[string]policies.Worker{}
			for op := 0; op < 5000; op++ {
				id := fmt.Sprintf("g%d", rng.IntN(3*limit))
				if rng.IntN(2) == 0 {
					w, ok := g.get(id)
					mw, mok := bound[id]
					if ok != mok || w != mw {
						t.Fatalf("op %d: get(%s) = %v, %v; model %v, %v", op, id, w, ok, mw, mok)
					}
					continue
				}
				w := policies.Worker{WorkerID: uint64(rng.IntN(4))}
				g.put(id, w)
				if i := slices.Index(model, id); i >= 0 {
					model = slices.Delete(model, i, i+1)
				} else if len(model) == limit {
					delete(bound, model[0])
					model = model[1:]
				}
				model = append(model, id)
				bound[id] = w
			}
			if len(g.slots) != len(model) || len(g.index) != len(model) {
				t.Fatalf("table holds %d slots, %d index entries; model %d", len(g.slots), len(g.index), len(model))
			}
			// Walk the recency list from the least recently used end.
			var got []string
			for i := g.tail; i >= 0; i = g.slots[i].prev {
				got = append(got, g.slots[i].id)
			}
			if !slices.Equal(got, model) {
				t.Fatalf("recency order %v, model %v", got, model)
			}
		})
	}
}
