package main

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"time"
)

// progress shows replay progress: an in-place bar redrawn at most every 200 ms when the output is
// a terminal, otherwise one line every 5 s (and at the end).
type progress struct {
	mu       sync.Mutex
	w        io.Writer
	tty      bool
	name     string
	total    int
	start    time.Time
	last     time.Time
	lastDone int
}

func newProgress(w io.Writer, tty bool, name string, total int) *progress {
	return &progress{w: w, tty: tty, name: name, total: total, start: time.Now(), lastDone: -1}
}

// update reports done completed requests.
func (p *progress) update(done int) {
	if p == nil || p.w == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	interval := 5 * time.Second
	if p.tty {
		interval = 200 * time.Millisecond
	}
	if done == p.lastDone || (now.Sub(p.last) < interval && done != p.total) {
		return
	}
	p.last, p.lastDone = now, done
	elapsed := now.Sub(p.start).Truncate(100 * time.Millisecond)
	if p.tty {
		const width = 30
		filled := 0
		if p.total > 0 {
			filled = done * width / p.total
		}
		fmt.Fprintf(p.w, "\r%-22s [%s%s] %d/%d  %v ", p.name, strings.Repeat("#", filled), strings.Repeat(".", width-filled), done, p.total, elapsed)
		return
	}
	fmt.Fprintf(p.w, "eppbench: %s: %d/%d requests done, %v\n", p.name, done, p.total, elapsed)
}

// finish ends the display (a newline after the bar).
func (p *progress) finish() {
	if p == nil || p.w == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty {
		fmt.Fprintln(p.w)
	}
}
