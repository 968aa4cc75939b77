package discovery

import (
	"testing"

	sip13 "github.com/dgryski/go-sip13"
)

// TestHashPodName checks the three worker-id vectors of epp.md §10.3, masked and unmasked.
func TestHashPodName(t *testing.T) {
	for _, tc := range []struct {
		name             string
		masked, unmasked uint64
	}{
		{"vllm-0", 1943803597606491, 5739529728867618395},
		{"vllm-qwen-0", 5438949109795618, 9553070159135247138},
		{"worker-0", 1186445869714687, 12863466981639851263},
	} {
		if got := HashPodName(tc.name); got != tc.masked {
			t.Errorf("HashPodName(%q) = %d, want %d", tc.name, got, tc.masked)
		}
		if got := sip13.Sum64(0, 0, append([]byte(tc.name), 0xFF)); got != tc.unmasked {
			t.Errorf("SipHash-1-3(%q ‖ 0xFF) = %d, want %d", tc.name, got, tc.unmasked)
		}
	}
}
