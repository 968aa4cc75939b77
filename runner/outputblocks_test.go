package runner

import (
	"io"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/internal/sharedtest"
)

// TestTrackOutputBlocksReachesTheSelectionCore checks that DYN_ROUTER_TRACK_OUTPUT_BLOCKS
// (default false, Dynamo's) is what the picker's OutputTokens honours, so the EPP's response path
// grows bookings only when it is set.
func TestTrackOutputBlocksReachesTheSelectionCore(t *testing.T) {
	tok := "DYN_EPP_TOKENIZER_DIR=" + sharedtest.Qwen3TokenizerDir(t)
	for _, tc := range []struct {
		env  []string
		want bool
	}{
		{[]string{tok}, false},
		{[]string{tok, "DYN_ROUTER_TRACK_OUTPUT_BLOCKS=true"}, true},
	} {
		cfg, err := LoadConfig(tc.env, nil, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		pc, err := PickerConfig(cfg, catalog.Builtins())
		if err != nil {
			t.Fatal(err)
		}
		if pc.Router.TrackOutputBlocks != tc.want {
			t.Fatalf("%v: picker TrackOutputBlocks %v, want %v", tc.env, pc.Router.TrackOutputBlocks, tc.want)
		}
	}
}
