package tokenizer

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// ResolveDir finds the directory holding tokenizer.json for a DYN_EPP_TOKENIZER_DIR value, as an
// operator's machine already has the files (no download). dir may be
//
//   - a directory with tokenizer.json (used as is);
//   - a Hugging Face cache repository folder hub/models--org--name;
//   - a Hugging Face cache (HF_HOME, holding hub/, or the hub folder itself, holding
//     models--*), in which modelID ("org/name", e.g. DYN_MODEL_NAME) is resolved;
//   - a model id "org/name" that is not a directory, resolved in $HF_HUB_CACHE, else
//     $HF_HOME/hub, else ~/.cache/huggingface/hub.
//
// Inside a repository folder the snapshot named by refs/main is used (an unusable refs/main is
// an error: resolveSnapshot), else, without refs/main, the only snapshot with a tokenizer.json,
// else the most recently modified one. Errors say what was looked for.
func ResolveDir(dir, modelID string) (string, error) {
	if dir == "" {
		return "", errors.New("no tokenizer directory given")
	}
	if fileExists(filepath.Join(dir, "tokenizer.json")) {
		return dir, nil
	}
	st, err := os.Stat(dir)
	if err != nil {
		if looksLikeModelID(dir) {
			return resolveInCache(defaultHubCache(), dir)
		}
		return "", err
	}
	if !st.IsDir() {
		return "", fmt.Errorf("%s is not a directory", dir)
	}
	if strings.HasPrefix(filepath.Base(filepath.Clean(dir)), "models--") {
		return resolveSnapshot(dir)
	}
	hub := dir
	if isDir(filepath.Join(dir, "hub")) {
		hub = filepath.Join(dir, "hub")
	}
	if modelID == "" {
		return "", fmt.Errorf("%s has no tokenizer.json and no model id was given to resolve in it as a Hugging Face cache (set DYN_MODEL_NAME)", dir)
	}
	return resolveInCache(hub, modelID)
}

func fileExists(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir()
}

func isDir(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

func looksLikeModelID(s string) bool {
	parts := strings.Split(s, "/")
	return len(parts) == 2 && parts[0] != "" && parts[1] != "" && !strings.HasPrefix(s, ".")
}

// defaultHubCache is huggingface_hub's cache location: $HF_HUB_CACHE, $HF_HOME/hub, or
// ~/.cache/huggingface/hub.
func defaultHubCache() string {
	if d := os.Getenv("HF_HUB_CACHE"); d != "" {
		return d
	}
	if d := os.Getenv("HF_HOME"); d != "" {
		return filepath.Join(d, "hub")
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return filepath.Join(".cache", "huggingface", "hub")
	}
	return filepath.Join(home, ".cache", "huggingface", "hub")
}

// resolveInCache finds modelID's repository folder models--org--name in hub.
func resolveInCache(hub, modelID string) (string, error) {
	if !looksLikeModelID(modelID) {
		return "", fmt.Errorf("model id %q is not of the form org/name", modelID)
	}
	repo := filepath.Join(hub, "models--"+strings.ReplaceAll(modelID, "/", "--"))
	if !isDir(repo) {
		return "", fmt.Errorf("model %q is not in the Hugging Face cache %s (looked for %s; kvepp never downloads)", modelID, hub, repo)
	}
	return resolveSnapshot(repo)
}

// resolveSnapshot picks the snapshot of a cache repository folder: the one refs/main names when
// there is a refs/main — the revision the engine loads, so a refs/main that is empty, is not a
// plain snapshot name (a path such as ../../x is never followed), or names a snapshot without
// tokenizer.json is an error rather than a reason to load another revision —, else the only
// snapshot with a tokenizer.json, else the most recently modified one.
func resolveSnapshot(repo string) (string, error) {
	ref, err := os.ReadFile(filepath.Join(repo, "refs", "main"))
	switch {
	case err == nil:
		name := strings.TrimSpace(string(ref))
		refPath := filepath.Join(repo, "refs", "main")
		switch {
		case name == "":
			return "", fmt.Errorf("%s is empty; it should name the snapshot (commit hash) to use", refPath)
		case name == "." || name == ".." || strings.ContainsAny(name, `/\`) || strings.ContainsRune(name, 0):
			return "", fmt.Errorf("%s holds %q, not a snapshot name; refusing to follow it", refPath, truncate(name, 100))
		}
		snap := filepath.Join(repo, "snapshots", name)
		if !fileExists(filepath.Join(snap, "tokenizer.json")) {
			return "", fmt.Errorf("%s names snapshot %q, which has no tokenizer.json (%s); the engine loads that revision, so kvepp does not pick another: download it or fix refs/main",
				refPath, truncate(name, 100), snap)
		}
		return snap, nil
	case !errors.Is(err, os.ErrNotExist):
		return "", fmt.Errorf("read %s: %w", filepath.Join(repo, "refs", "main"), err)
	}
	entries, err := os.ReadDir(filepath.Join(repo, "snapshots"))
	if err != nil {
		return "", fmt.Errorf("%s is not a Hugging Face cache repository: %w", repo, err)
	}
	type cand struct {
		path string
		mod  int64
	}
	var cands []cand
	for _, e := range entries {
		p := filepath.Join(repo, "snapshots", e.Name())
		st, err := os.Stat(filepath.Join(p, "tokenizer.json"))
		if err != nil {
			continue
		}
		cands = append(cands, cand{p, st.ModTime().UnixNano()})
	}
	if len(cands) == 0 {
		return "", fmt.Errorf("no snapshot under %s has a tokenizer.json", filepath.Join(repo, "snapshots"))
	}
	sort.Slice(cands, func(i, j int) bool { return cands[i].mod > cands[j].mod })
	return cands[0].path, nil
}
