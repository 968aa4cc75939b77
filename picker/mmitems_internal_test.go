package picker

import (
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestBlockMMHashes(t *testing.T) {
	tests := []struct {
		name  string
		items []MMItem
		n     int
		want  [][]uint64
	}{
		{"no items hash nothing extra", nil, 40, nil},
		{"an item spanning blocks 1 and 2 marks both", []MMItem{{Start: 20, End: 40, Hash: 7}}, 48, [][]uint64{nil, {7}, {7}}},
		{"an item in the partial tail block marks nothing", []MMItem{{Start: 33, End: 40, Hash: 7}}, 40, nil},
		{"two items in one block keep their order", []MMItem{{Start: 0, End: 2, Hash: 9}, {Start: 3, End: 4, Hash: 1}}, 16, [][]uint64{{9, 1}}},
		{"an empty range is ignored", []MMItem{{Start: 5, End: 5, Hash: 3}}, 32, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := blockMMHashes(tc.items, tc.n, 16); !cmp.Equal(got, tc.want) {
				t.Fatalf("blockMMHashes = %v, want %v", got, tc.want)
			}
		})
	}
}
