//go:build linux

package kvindex

import "syscall"

// rusageThread is Linux's RUSAGE_THREAD (the calling thread only).
const rusageThread = 1

// threadState returns the calling thread and how many times the OS has preempted it
// (involuntary context switches), or ok = false when that is not known.
func threadState() (tid int, preemptions int64, ok bool) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(rusageThread, &ru); err != nil {
		return 0, 0, false
	}
	return syscall.Gettid(), ru.Nivcsw, true
}
