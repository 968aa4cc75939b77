// Package catalogtest checks policy packages' documentation against the catalog: the YAML
// example a policy's README shows must select that policy (selection-service.md §18).
package catalogtest

import (
	"os"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/policies"
)

// ResolveREADME reads README.md in the test's package directory, takes its first ```yaml block,
// and resolves it (catalog.ParseConfig, catalog.Resolve with no environment override) through a
// registry holding only typeName → provider. It fails t when the README or its example is
// missing, when parsing or resolution fails, or when the example does not select typeName as a
// registered (non-built-in) type; otherwise it returns the resolution.
func ResolveREADME(t testing.TB, typeName string, provider policies.Provider) *catalog.Resolution {
	t.Helper()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, example, ok := strings.Cut(string(readme), "```yaml\n")
	if !ok {
		t.Fatal("README.md has no yaml example")
	}
	example, _, _ = strings.Cut(example, "```")
	reg := catalog.NewRegistry()
	if err := reg.Register(typeName, provider); err != nil {
		t.Fatal(err)
	}
	cfg, err := catalog.ParseConfig([]byte(example))
	if err != nil {
		t.Fatal(err)
	}
	res, err := catalog.Resolve(reg, cfg, "")
	if err != nil {
		t.Fatal(err)
	}
	if res.Type != typeName || res.Builtin {
		t.Fatalf("the README example resolves to %+v", res)
	}
	return res
}
