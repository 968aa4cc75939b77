package predictedttft

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// TestNthSmallestMatchesSorting checks the quickselect against sorting on random, sorted,
// reversed and constant inputs with duplicates, for every k.
func TestNthSmallestMatchesSorting(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	inputs := [][]float64{{1}, {2, 1}, {3, 3, 3, 3}}
	for _, n := range []int{3, 7, 8, 33, 100} {
		random, sorted, dups := make([]float64, n), make([]float64, n), make([]float64, n)
		for i := range random {
			random[i], sorted[i], dups[i] = rng.Float64(), float64(i), float64(rng.IntN(3))
		}
		reversed := slices.Clone(sorted)
		slices.Reverse(reversed)
		inputs = append(inputs, random, sorted, reversed, dups)
	}
	for _, in := range inputs {
		want := slices.Sorted(slices.Values(in))
		for k := range in {
			if got := nthSmallest(slices.Clone(in), k); got != want[k] {
				t.Fatalf("nthSmallest(%v, %d) = %v, want %v", in, k, got, want[k])
			}
		}
	}
}
