package helpertest_test

import (
	"slices"
	"testing"

	"github.com/kvepp/kvepp/internal/helpertest"
)

func TestFailures(t *testing.T) {
	t.Run("errors are recorded in order and a fatal failure stops the helper", func(t *testing.T) {
		reached := false
		got := helpertest.Failures(t, func(tb testing.TB) {
			tb.Error("a", 1)
			tb.Errorf("b %d", 2)
			tb.Fatalf("c %s", "3")
			reached = true
		})
		if want := []string{"a1", "b 2", "c 3"}; !slices.Equal(got, want) || reached {
			t.Fatalf("messages %q (want %q), ran past Fatalf: %v", got, want, reached)
		}
	})
	t.Run("a helper that does not fail records nothing", func(t *testing.T) {
		if got := helpertest.Failures(t, func(tb testing.TB) { tb.Log("fine") }); len(got) != 0 {
			t.Fatalf("messages %q", got)
		}
	})
	t.Run("Fatal records its arguments like fmt.Sprint", func(t *testing.T) {
		if got := helpertest.Failures(t, func(tb testing.TB) { tb.Fatal("x", "y") }); !slices.Equal(got, []string{"xy"}) {
			t.Fatalf("messages %q", got)
		}
	})
}
