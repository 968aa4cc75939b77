package runner

import (
	"bufio"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/internal/sharedtest"
)

// dockerignoreMatcher compiles .dockerignore patterns with Docker's rules: paths relative to the
// context root, '*' and '?' within one path segment, "**/" any number of directories, and a
// path excluded when it or one of its parent directories matches. Negations are not used here.
func dockerignoreMatcher(t *testing.T, path string) func(string) bool {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatalf("open %s: %v", path, err)
	}
	defer f.Close()
	var res []*regexp.Regexp
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if strings.HasPrefix(line, "!") {
			t.Fatalf("negated pattern %q: extend the matcher", line)
		}
		p := filepath.ToSlash(filepath.Clean(strings.TrimPrefix(line, "/")))
		var b strings.Builder
		b.WriteString("^")
		for i := 0; i < len(p); i++ {
			switch {
			case strings.HasPrefix(p[i:], "**/"):
				b.WriteString("(.*/)?")
				i += 2
			case strings.HasPrefix(p[i:], "**"):
				b.WriteString(".*")
				i++
			case p[i] == '*':
				b.WriteString("[^/]*")
			case p[i] == '?':
				b.WriteString("[^/]")
			default:
				b.WriteString(regexp.QuoteMeta(p[i : i+1]))
			}
		}
		b.WriteString("$")
		res = append(res, regexp.MustCompile(b.String()))
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return func(rel string) bool {
		for p := rel; p != "." && p != "/" && p != ""; p = filepath.ToSlash(filepath.Dir(p)) {
			for _, re := range res {
				if re.MatchString(p) {
					return true
				}
			}
		}
		return false
	}
}

func TestDockerignoreKeepsBuildOutputsOutOfTheContext(t *testing.T) {
	excluded := dockerignoreMatcher(t, filepath.Join(sharedtest.RepoRoot(t), ".dockerignore"))
	for _, tc := range []struct {
		path string
		want bool
	}{
		{".git/config", true},
		{".git", true},
		{"runner.test", true},
		{"runner/runner.test", true},
		{"eppbench-out/results.json", true},
		{"bin/epp", true},
		{"go.mod", false},
		{"go.sum", false},
		{"cmd/epp/main.go", false},
		{"runner/runner.go", false},
		{"picker/httpapi/testdata/x.json", false},
		{"kvindex/testdata/x", false},
	} {
		verb := "keeps"
		if tc.want {
			verb = "excludes"
		}
		t.Run("the build context "+verb+" "+tc.path, func(t *testing.T) {
			if got := excluded(tc.path); got != tc.want {
				t.Fatalf("excluded(%q) = %v, want %v", tc.path, got, tc.want)
			}
		})
	}
}
