package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kvepp/kvepp/internal/benchbody"
)

// loadBody is one request body of `eppbench load`, labelled by its --body spec.
type loadBody struct {
	Name string
	*benchbody.Body
}

// parseLoadBody resolves a --body spec: a golden vector name of shared/golden/qwen3-requests.json
// (e.g. chat-long), @FILE for a JSON request body, or conv:turns=N[,turn-bytes=B][,model=M] for a
// synthetic conversation (benchbody.Conversation; model defaults to Qwen/Qwen3-0.6B).
func parseLoadBody(spec, sharedDir string) (*loadBody, error) {
	wrap := func(raw []byte, path string) (*loadBody, error) {
		b, err := benchbody.New(raw, path)
		if err != nil {
			return nil, fmt.Errorf("--body %s: %w", spec, err)
		}
		return &loadBody{Name: spec, Body: b}, nil
	}
	switch {
	case strings.HasPrefix(spec, "@"):
		raw, err := os.ReadFile(spec[1:])
		if err != nil {
			return nil, fmt.Errorf("--body %s: %w", spec, err)
		}
		return wrap(raw, "")
	case strings.HasPrefix(spec, "conv:"):
		turns, turnBytes, model := 0, benchbody.DefaultTurnBytes, "Qwen/Qwen3-0.6B"
		for _, kv := range strings.Split(spec[len("conv:"):], ",") {
			k, v, _ := strings.Cut(kv, "=")
			var err error
			switch k {
			case "turns":
				turns, err = strconv.Atoi(v)
			case "turn-bytes":
				turnBytes, err = strconv.Atoi(v)
			case "model":
				model = v
			default:
				return nil, fmt.Errorf("--body %s: unknown key %q (want turns, turn-bytes, model)", spec, k)
			}
			if err != nil {
				return nil, fmt.Errorf("--body %s: %s: %w", spec, k, err)
			}
		}
		if turns < 1 || turns > 10000 || turnBytes < 16 || turnBytes > 1<<20 {
			return nil, fmt.Errorf("--body %s: want turns in 1..10000 and turn-bytes in 16..1048576", spec)
		}
		return wrap(benchbody.Conversation(model, turns, turnBytes), "")
	}
	path := filepath.Join(sharedDir, "golden", "qwen3-requests.json")
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--body %s: golden vectors: %w (set --shared)", spec, err)
	}
	var doc struct {
		Vectors []struct {
			Name string          `json:"name"`
			Path string          `json:"path"`
			Body json.RawMessage `json:"body"`
		} `json:"vectors"`
	}
	if err := json.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("--body %s: %s: %w", spec, path, err)
	}
	var names []string
	for _, v := range doc.Vectors {
		if v.Name == spec {
			return wrap(v.Body, v.Path)
		}
		names = append(names, v.Name)
	}
	return nil, fmt.Errorf("--body %q: not @FILE, conv:… or a golden vector (%s)", spec, strings.Join(names, ", "))
}

// bytesFor returns the body of request n: unique (benchbody.Body.Unique) or Raw.
func (b *loadBody) bytesFor(unique bool, run string, n uint64) []byte {
	if !unique {
		return b.Raw
	}
	return b.Unique(run, n)
}
