package tokenizer

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// makeHFCache lays out HF_HOME/hub/models--org--name/snapshots/<rev>/tokenizer.json with
// refs/main naming rev, as huggingface_hub leaves it (snapshot files there are symlinks into
// blobs/; a symlink is used here too).
func makeHFCache(t *testing.T, model string, revs ...string) (home string) {
	t.Helper()
	home = t.TempDir()
	repo := filepath.Join(home, "hub", "models--"+strings.ReplaceAll(model, "/", "--"))
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(repo, "blobs"), 0o755))
	must(os.WriteFile(filepath.Join(repo, "blobs", "abc"), []byte("{}"), 0o644))
	for _, rev := range revs {
		snap := filepath.Join(repo, "snapshots", rev)
		must(os.MkdirAll(snap, 0o755))
		must(os.Symlink(filepath.Join("..", "..", "blobs", "abc"), filepath.Join(snap, "tokenizer.json")))
	}
	must(os.MkdirAll(filepath.Join(repo, "refs"), 0o755))
	must(os.WriteFile(filepath.Join(repo, "refs", "main"), []byte(revs[0]+"\n"), 0o644))
	return home
}

func TestResolveDir(t *testing.T) {
	home := makeHFCache(t, "org/model", "rev1", "rev2")
	want := filepath.Join(home, "hub", "models--org--model", "snapshots", "rev1")
	plain := t.TempDir()
	if err := os.WriteFile(filepath.Join(plain, "tokenizer.json"), []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("HF_HUB_CACHE", "")
	t.Setenv("HF_HOME", home)
	tests := []struct{ name, dir, model, want, err string }{
		{"a directory with tokenizer.json is used as is", plain, "org/model", plain, ""},
		{"HF_HOME and a model id resolve to refs/main's snapshot", home, "org/model", want, ""},
		{"the hub folder and a model id resolve too", filepath.Join(home, "hub"), "org/model", want, ""},
		{"a repository folder resolves to its snapshot", filepath.Join(home, "hub", "models--org--model"), "", want, ""},
		{"a bare model id resolves in $HF_HOME/hub", "org/model", "", want, ""},
		{"a model missing from the cache is an error naming what was looked for", home, "org/other", "", "models--org--other"},
		{"a cache without a model id is an error", home, "", "", "no model id"},
		{"a missing directory is an error", filepath.Join(plain, "nope"), "", "", "no such file"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ResolveDir(tc.dir, tc.model)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want one containing %q", err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("ResolveDir = %q, %v; want %q", got, err, tc.want)
			}
		})
	}
	t.Run("without refs/main the newest snapshot with a tokenizer.json wins", func(t *testing.T) {
		h := makeHFCache(t, "a/b", "old", "new")
		repo := filepath.Join(h, "hub", "models--a--b")
		os.Remove(filepath.Join(repo, "refs", "main"))
		got, err := ResolveDir(repo, "")
		if err != nil || (filepath.Base(got) != "old" && filepath.Base(got) != "new") {
			t.Fatalf("ResolveDir = %q, %v", got, err)
		}
	})
}

// TestResolveDirRefusesABadRefsMain: refs/main names the revision the engine loads, so a
// refs/main kvepp cannot follow is an error naming it — never another snapshot, never a path
// outside the repository's snapshots.
func TestResolveDirRefusesABadRefsMain(t *testing.T) {
	for _, tc := range []struct{ name, ref, want string }{
		{"a snapshot without tokenizer.json", "empty", `refs/main names snapshot "empty", which has no tokenizer.json`},
		{"a missing snapshot", "deadbeef", `refs/main names snapshot "deadbeef", which has no tokenizer.json`},
		{"a path out of the repository", "../../../../tmp", `refs/main holds "../../../../tmp", not a snapshot name`},
		{"a nested path", "rev1/../rev1", `refs/main holds "rev1/../rev1", not a snapshot name`},
		{"an empty refs/main", "", `refs/main is empty`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			home := makeHFCache(t, "org/model", "rev1")
			repo := filepath.Join(home, "hub", "models--org--model")
			if err := os.MkdirAll(filepath.Join(repo, "snapshots", "empty"), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(repo, "refs", "main"), []byte(tc.ref+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			got, err := ResolveDir(repo, "")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("ResolveDir = %q, %v; want an error containing %q", got, err, tc.want)
			}
		})
	}
}
