//go:build !linux

package kvindex

// threadState is not known on this platform.
func threadState() (tid int, preemptions int64, ok bool) { return 0, 0, false }
