// Package discovery holds the sources of the worker catalog (epp.md §2, §10; selection-service.md
// §4.2): a watched workers file (FileSource) and a Kubernetes InferencePool with its pods
// (PoolSource, fed by the process's one controller-runtime cluster, NewKube). A source turns what
// it observes into full snapshots of worker records and applies each snapshot to the catalog as a
// diff — upsert new or changed records with source "discovery", delete then re-register workers
// whose process changed, update which registered workers are candidates, delete the discovery
// workers that vanished — retrying a failed apply after 5 s unless a newer snapshot arrives first.
package discovery

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/kvepp/kvepp/picker"
	"github.com/rs/zerolog"
	"sigs.k8s.io/yaml"
)

// Catalog is the part of the worker catalog a discovery source drives. *picker.Service satisfies
// it. Workers("", "") must list every worker of every partition.
type Catalog interface {
	// UpsertWorker registers or replaces the whole record of rec.WorkerID.
	UpsertWorker(ctx context.Context, rec picker.WorkerRecord, source picker.Source) (picker.WorkerState, error)
	// DeleteWorker removes a worker; a picker error of kind not_found means it is already gone.
	DeleteWorker(ctx context.Context, workerID uint64) (picker.WorkerState, error)
	// Workers lists the catalog, optionally filtered by partition ("" = any).
	Workers(modelName, routingGroup string) []picker.WorkerState
}

// Defaults fill fields a workers-file record omits.
type Defaults struct {
	// BlockSize (tokens) is given to records without block_size: DYN_KV_CACHE_BLOCK_SIZE. 0 = none.
	BlockSize uint32
	// ModelName is given to records without model_name: DYN_MODEL_NAME. "" = leave empty (the
	// catalog then uses "default").
	ModelName string
	// MaxNumBatchedTokens (tokens) is given to records without max_num_batched_tokens:
	// DYN_EPP_MAX_NUM_BATCHED_TOKENS. 0 = none.
	MaxNumBatchedTokens uint64
	// TotalKVBlocks (blocks) is given to records without total_kv_blocks: DYN_EPP_TOTAL_KV_BLOCKS.
	// 0 = none.
	TotalKVBlocks uint64
}

// ParseWorkers decodes a workers file: a YAML or JSON list of worker records in the POST /workers
// schema (selection-service.md §4.1), parsed with sigs.k8s.io/yaml. Unknown fields are rejected so a
// misspelt key is an error rather than a silently incomplete worker; every record needs worker_id
// and ids must be unique, and model_name and routing_group must pass picker.ValidateName (a file
// cannot register a name the API would refuse). Defaults fill block_size, model_name, max_num_batched_tokens and
// total_kv_blocks where omitted. Only an explicit empty list ([] in YAML or JSON) means "no
// workers": an empty or whitespace-only file, and a document that decodes to nothing (only
// comments, only "---" separators, null or ~), are errors, so a truncated or half-written file
// never deletes the catalog. Errors name the record by position (0-based) and worker_id.
func ParseWorkers(data []byte, d Defaults) ([]picker.WorkerRecord, error) {
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, errors.New("workers file is empty (write [] for no workers)")
	}
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil, fmt.Errorf("workers file is not valid YAML or JSON: %w", err)
	}
	if t := bytes.TrimSpace(js); len(t) == 0 || bytes.Equal(t, []byte("null")) {
		return nil, errors.New("workers file has no worker list: it holds only comments, document separators or null (write [] for no workers)")
	}
	var items []json.RawMessage
	if err := json.Unmarshal(js, &items); err != nil {
		return nil, errors.New("workers file must be a list of worker records")
	}
	out := make([]picker.WorkerRecord, 0, len(items))
	seen := make(map[uint64]int, len(items))
	for i, raw := range items {
		var probe map[string]json.RawMessage
		if err := json.Unmarshal(raw, &probe); err != nil || probe == nil {
			return nil, fmt.Errorf("worker record %d: must be an object", i)
		}
		if _, ok := probe["worker_id"]; !ok {
			return nil, fmt.Errorf("worker record %d: worker_id is required", i)
		}
		var rec picker.WorkerRecord
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&rec); err != nil {
			return nil, fmt.Errorf("worker record %d (worker_id %s): %w", i, probe["worker_id"], err)
		}
		if j, dup := seen[rec.WorkerID]; dup {
			return nil, fmt.Errorf("worker record %d: worker_id %d is already used by record %d", i, rec.WorkerID, j)
		}
		seen[rec.WorkerID] = i
		if rec.BlockSize == nil && d.BlockSize > 0 {
			bs := d.BlockSize
			rec.BlockSize = &bs
		}
		if rec.ModelName == "" && d.ModelName != "" {
			rec.ModelName = d.ModelName
		}
		for _, f := range []struct{ field, name string }{{"model_name", rec.ModelName}, {"routing_group", rec.RoutingGroup}} {
			if err := picker.ValidateName(f.field, f.name); err != nil {
				return nil, fmt.Errorf("worker record %d (worker_id %d): %w", i, rec.WorkerID, err)
			}
		}
		if rec.MaxNumBatchedTokens == nil && d.MaxNumBatchedTokens > 0 {
			v := d.MaxNumBatchedTokens
			rec.MaxNumBatchedTokens = &v
		}
		if rec.TotalKVBlocks == nil && d.TotalKVBlocks > 0 {
			v := d.TotalKVBlocks
			rec.TotalKVBlocks = &v
		}
		out = append(out, rec)
	}
	return out, nil
}

// FileConfig configures a FileSource.
type FileConfig struct {
	// Path is the workers file (DYN_EPP_WORKERS_FILE). Its directory is watched, so editors that
	// replace the file by rename and Kubernetes ConfigMap symlink swaps are both seen.
	Path string
	// Defaults fill omitted record fields.
	Defaults Defaults
	// Debounce coalesces bursts of file events (default 200 ms).
	Debounce time.Duration
	// RetryInterval is the wait before re-applying a failed snapshot (default 5 s).
	RetryInterval time.Duration
	// OpTimeout bounds one catalog operation (default 30 s).
	OpTimeout time.Duration
	// Logger receives apply, parse and retry logs.
	Logger zerolog.Logger
}

// FileStats are a FileSource's counters.
type FileStats struct {
	// Applied counts snapshots applied completely.
	Applied uint64
	// ApplyFailures counts snapshots whose apply failed (each is retried).
	ApplyFailures uint64
	// Reads counts reads of the file: the one at Start and one per (debounced) change seen in its
	// directory.
	Reads uint64
	// InvalidFiles counts distinct invalid contents (or read errors) seen: a content that does not
	// read or parse is counted and logged once however often it is read again (the catalog is left
	// as it was).
	InvalidFiles uint64
	// Workers is the number of workers the source currently owns.
	Workers int
	// Pending is true while a failed snapshot waits for its retry.
	Pending bool
}

// FileSource keeps the catalog equal to a workers file. Create it with NewFileSource, call Start
// once, and Close when done. Safe for concurrent use of Stats.
type FileSource struct {
	cfg FileConfig
	cat Catalog
	log zerolog.Logger

	// rec applies snapshots as diffs and remembers the workers this source registered.
	rec *reconciler
	// lastContent is the file content of the last fully applied snapshot.
	lastContent []byte

	mu    sync.Mutex
	stats FileStats

	watcher *fsnotify.Watcher
	cancel  context.CancelFunc
	done    chan struct{}
	started bool
}

// NewFileSource returns a source for cfg.Path that will drive cat. It does not touch the file yet.
func NewFileSource(cfg FileConfig, cat Catalog) (*FileSource, error) {
	if cfg.Path == "" {
		return nil, errors.New("workers file path is empty")
	}
	if cat == nil {
		return nil, errors.New("workers file source needs a catalog")
	}
	if cfg.Debounce <= 0 {
		cfg.Debounce = 200 * time.Millisecond
	}
	if cfg.RetryInterval <= 0 {
		cfg.RetryInterval = 5 * time.Second
	}
	if cfg.OpTimeout <= 0 {
		cfg.OpTimeout = 30 * time.Second
	}
	abs, err := filepath.Abs(cfg.Path)
	if err != nil {
		return nil, fmt.Errorf("workers file %q: %w", cfg.Path, err)
	}
	cfg.Path = abs
	log := cfg.Logger.With().Str("component", "discovery").Str("workers_file", abs).Logger()
	return &FileSource{
		cfg:  cfg,
		cat:  cat,
		log:  log,
		rec:  newReconciler(cat, log, cfg.OpTimeout, "workers file"),
		done: make(chan struct{}),
	}, nil
}

// Start reads, parses and applies the file once, synchronously, then watches it until ctx ends or
// Close is called. A missing, unreadable or invalid file, or a failed initial apply, is returned
// as an error (startup must not proceed on a broken catalog source); later failures are logged and
// leave the catalog as it was.
func (s *FileSource) Start(ctx context.Context) error {
	if s.started {
		return errors.New("workers file source already started")
	}
	s.started = true
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch workers file %q: %w", s.cfg.Path, err)
	}
	if err := w.Add(filepath.Dir(s.cfg.Path)); err != nil {
		_ = w.Close()
		return fmt.Errorf("watch workers file %q: %w", s.cfg.Path, err)
	}
	data, recs, err := s.read()
	if err != nil {
		_ = w.Close()
		return err
	}
	if err := s.apply(ctx, recs); err != nil {
		_ = w.Close()
		return fmt.Errorf("apply workers file %q: %w", s.cfg.Path, err)
	}
	s.lastContent = data
	s.watcher = w
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.cancel = cancel
	go func() {
		select {
		case <-ctx.Done():
			cancel()
		case <-runCtx.Done():
		}
	}()
	go s.loop(runCtx)
	return nil
}

// Close stops watching and waits for the watch loop to exit. It does not remove the workers it
// registered (shutdown keeps the catalog; the process exits). Safe to call more than once.
func (s *FileSource) Close() error {
	if s.cancel == nil {
		return nil
	}
	s.cancel()
	<-s.done
	return nil
}

// Stats returns a snapshot of the counters.
func (s *FileSource) Stats() FileStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats
}

// read loads and parses the file. On a parse error it still returns the content it read.
func (s *FileSource) read() ([]byte, []picker.WorkerRecord, error) {
	s.mu.Lock()
	s.stats.Reads++
	s.mu.Unlock()
	data, err := os.ReadFile(s.cfg.Path)
	if err != nil {
		return nil, nil, fmt.Errorf("read workers file: %w", err)
	}
	recs, err := ParseWorkers(data, s.cfg.Defaults)
	if err != nil {
		return data, nil, fmt.Errorf("workers file %q: %w", s.cfg.Path, err)
	}
	return data, recs, nil
}

// invalidSignature identifies an invalid read for logging it once: its error and content.
func invalidSignature(data []byte, err error) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(err.Error()))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write(data)
	return h.Sum64()
}

// fileSnapshot is one parsed version of the workers file.
type fileSnapshot struct {
	recs    []picker.WorkerRecord
	content []byte
}

// loop serializes every apply: file events (debounced), retries, shutdown.
func (s *FileSource) loop(ctx context.Context) {
	defer close(s.done)
	defer s.watcher.Close()
	debounce := time.NewTimer(time.Hour)
	debounce.Stop()
	retry := newRetrier[fileSnapshot](s.cfg.RetryInterval)
	defer retry.stop()
	// lastInvalid is the signature of the invalid read last logged (0: the last read was valid),
	// so one garbled write is reported once however many directory events re-read it.
	var lastInvalid uint64

	attempt := func(snap fileSnapshot) {
		if err := s.apply(ctx, snap.recs); err != nil {
			if ctx.Err() != nil {
				return
			}
			s.log.Error().Err(err).Int64("retry_in_ms", s.cfg.RetryInterval.Milliseconds()).Msg("workers file snapshot apply failed; will retry")
			retry.failed(snap)
			s.setPending(true, true)
			return
		}
		retry.succeeded()
		s.setPending(false, false)
		s.lastContent = snap.content
	}

	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-s.watcher.Events:
			if !ok {
				return
			}
			s.log.Debug().Str("event", ev.String()).Msg("workers file directory changed")
			debounce.Reset(s.cfg.Debounce)
		case err, ok := <-s.watcher.Errors:
			if !ok {
				return
			}
			s.log.Warn().Err(err).Msg("workers file watch error")
			debounce.Reset(s.cfg.Debounce)
		case <-debounce.C:
			data, recs, err := s.read()
			if err != nil {
				if sig := invalidSignature(data, err); sig != lastInvalid {
					lastInvalid = sig
					// Logged before it is counted, so whoever sees the count also finds the log line.
					s.log.Error().Err(err).Msg("workers file ignored; keeping the current catalog")
					s.mu.Lock()
					s.stats.InvalidFiles++
					s.mu.Unlock()
				}
				continue
			}
			wasInvalid := lastInvalid != 0
			lastInvalid = 0
			if !retry.isPending() && bytes.Equal(data, s.lastContent) {
				if wasInvalid {
					s.log.Info().Int("workers", len(recs)).Msg("workers file valid again; it matches the current catalog")
				}
				continue
			}
			// A newer snapshot supersedes a pending retry.
			attempt(fileSnapshot{recs: recs, content: data})
		case <-retry.C():
			if snap, ok := retry.due(); ok {
				s.log.Info().Msg("retrying workers file snapshot")
				attempt(snap)
			}
		}
	}
}

func (s *FileSource) setPending(pending, failed bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stats.Pending = pending
	if failed {
		s.stats.ApplyFailures++
	}
}

// apply makes the catalog match recs (reconciler.apply: upsert what is new, changed since this
// source last applied it, or differs from or is missing in the catalog; delete owned workers that
// are no longer listed). Every operation is attempted; the joined errors are returned.
func (s *FileSource) apply(ctx context.Context, recs []picker.WorkerRecord) error {
	want := make([]desiredWorker, len(recs))
	for i, r := range recs {
		want[i] = desiredWorker{rec: r, candidate: true}
	}
	res, err := s.rec.apply(ctx, want)
	s.mu.Lock()
	s.stats.Workers = len(s.rec.owned)
	if err == nil {
		s.stats.Applied++
	}
	s.mu.Unlock()
	if err != nil {
		return err
	}
	s.log.Info().Int("workers", len(recs)).Int("upserted", res.upserts).Int("deleted", res.deletes).Msg("workers file applied")
	return nil
}

// sameRecord compares two records by their JSON form after filling the partition defaults and
// normalizing taints to a sorted set, so a catalog that normalizes "" to "default", stores taints
// sorted without duplicates or drops empty maps does not look changed; the per-rank endpoints,
// which JSON does not carry, are compared too.
func sameRecord(a, b picker.WorkerRecord) bool {
	norm := func(r picker.WorkerRecord) []byte {
		if r.ModelName == "" {
			r.ModelName = picker.DefaultPartitionName
		}
		if r.RoutingGroup == "" {
			r.RoutingGroup = picker.DefaultPartitionName
		}
		r.Taints = picker.NormalizeTaints(r.Taints)
		b, _ := json.Marshal(r)
		return b
	}
	return bytes.Equal(norm(a), norm(b)) && slices.Equal(a.RankEndpoints, b.RankEndpoints)
}
