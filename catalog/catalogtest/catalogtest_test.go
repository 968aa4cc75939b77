package catalogtest_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog/catalogtest"
	"github.com/kvepp/kvepp/internal/helpertest"
	"github.com/kvepp/kvepp/policies/leastbusy"
)

// inDirWithREADME makes a temporary directory holding README.md with readme the working
// directory for the rest of the test.
func inDirWithREADME(t *testing.T, readme string) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "README.md"), []byte(readme), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Chdir(dir)
}

// resolveFailure runs ResolveREADME for least-busy and returns its failure message.
func resolveFailure(t *testing.T) string {
	return strings.Join(helpertest.Failures(t, func(tb testing.TB) {
		catalogtest.ResolveREADME(tb, leastbusy.TypeName, leastbusy.Provider)
	}), "\n")
}

const example = "# least-busy\n\n```yaml\nworker_selection:\n  default: lb\n  instances:\n    - name: lb\n      type: least-busy\n      parameters: {min_device_overlap_blocks: 0}\n```\n"

func TestResolveREADME(t *testing.T) {
	t.Run("the first yaml example resolves to the registered type", func(t *testing.T) {
		inDirWithREADME(t, example+"\n```yaml\nnot: [valid\n```\n")
		res := catalogtest.ResolveREADME(t, leastbusy.TypeName, leastbusy.Provider)
		if res.Name != "lb" || res.Type != leastbusy.TypeName || res.Builtin {
			t.Fatalf("resolution %+v", res)
		}
	})
	for _, tc := range []struct {
		name, readme, want string
	}{
		{"a README without a yaml example fails the test", "# nothing here\n", "no yaml example"},
		{"an example selecting the built-in policy fails the test", "```yaml\nworker_selection: {default: default}\n```\n", "resolves to"},
		{"an example with an invalid parameter fails the test naming it", strings.Replace(example, "min_device_overlap_blocks: 0", "min_device_overlap_blocks: -1", 1), "min_device_overlap_blocks"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inDirWithREADME(t, tc.readme)
			if msg := resolveFailure(t); !strings.Contains(msg, tc.want) {
				t.Fatalf("failure message %q, want it to contain %q", msg, tc.want)
			}
		})
	}
}
