package syncbuf_test

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/kvepp/kvepp/internal/syncbuf"
)

func TestConcurrentWritesAreAllKept(t *testing.T) {
	var b syncbuf.Buffer
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range 100 {
				fmt.Fprintf(&b, "%d-%d\n", i, j)
				_ = b.String() // readers run alongside writers
			}
		}()
	}
	wg.Wait()
	if n := strings.Count(b.String(), "\n"); n != 800 {
		t.Fatalf("%d lines, want 800", n)
	}
	got := b.Bytes()
	got[0] = '#'
	if b.String()[0] == '#' {
		t.Fatal("Bytes returned the buffer's own storage")
	}
}
