//go:build !race

package tokenizer

// raceEnabled scales down the randomized tests under the race detector (about 10x slower).
const raceEnabled = false
