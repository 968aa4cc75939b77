package discovery

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	inferencev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/kvepp/kvepp/picker"
)

// Pod annotations that override, for one pod, the pool-wide settings of its worker record, so a
// pool can mix GPU types (epp.md §10.3). Values are decimal integers; an invalid value is logged
// and the pool-wide setting is used instead.
const (
	// AnnotationTotalKVBlocks overrides DYN_EPP_TOTAL_KV_BLOCKS: the pod's total_kv_blocks
	// (blocks, > 0), e.g. vLLM's "GPU KV cache size" in tokens divided by the block size.
	AnnotationTotalKVBlocks = "kvepp.io/total-kv-blocks"
	// AnnotationMaxNumBatchedTokens overrides DYN_EPP_MAX_NUM_BATCHED_TOKENS: the pod's
	// max_num_batched_tokens (tokens, > 0), vLLM's --max-num-batched-tokens.
	AnnotationMaxNumBatchedTokens = "kvepp.io/max-num-batched-tokens"
	// AnnotationKVEventPort overrides DYN_EPP_KV_EVENT_PORT: the port the pod's rank 0 publishes
	// KV events on (rank r publishes on port + r), 1..65535.
	AnnotationKVEventPort = "kvepp.io/kv-event-port"
)

// Defaults of PoolConfig.
const (
	// DefaultKVEventPort is DYN_EPP_KV_EVENT_PORT's default: vLLM's --kv-events-config port.
	DefaultKVEventPort = 5557
	// DefaultRetryInterval is the wait before a failed snapshot apply is retried (epp.md §10.2).
	DefaultRetryInterval = 5 * time.Second
	// MaxTargetPorts is the most spec.targetPorts entries an InferencePool may have (epp.md §10.1).
	MaxTargetPorts = 8
)

// PoolConfig configures a PoolSource (epp.md §2, §10).
type PoolConfig struct {
	// Namespace is POD_NAMESPACE: the namespace of the pool and its pods. Required.
	Namespace string
	// Name is DYN_EPP_INFERENCE_POOL_NAME. Required.
	Name string
	// ModelName is DYN_MODEL_NAME, the partition model of every discovered worker. Required.
	ModelName string
	// BlockSize is DYN_KV_CACHE_BLOCK_SIZE in tokens (> 0).
	BlockSize uint32
	// KVEventPort is DYN_EPP_KV_EVENT_PORT: rank r of a pod publishes on port + r (default 5557).
	KVEventPort int
	// KVEventReplayPort is DYN_EPP_KV_EVENT_REPLAY_PORT: the replay (ROUTER) port of single-rank
	// pods; 0 = no replay.
	KVEventReplayPort int
	// MaxNumBatchedTokens (tokens) is DYN_EPP_MAX_NUM_BATCHED_TOKENS; 0 = none.
	MaxNumBatchedTokens uint64
	// TotalKVBlocks (blocks) is DYN_EPP_TOTAL_KV_BLOCKS; 0 = none.
	TotalKVBlocks uint64
	// RetryInterval is the wait before re-applying a failed snapshot (default 5 s).
	RetryInterval time.Duration
	// ReadRetryMin and ReadRetryMax bound the backoff between attempts to read the pool and its
	// pods after an API error (missing CRD, missing RBAC, unreachable API server): the wait
	// starts at ReadRetryMin (default 1 s) and doubles up to ReadRetryMax (default 30 s).
	ReadRetryMin, ReadRetryMax time.Duration
	// OpTimeout bounds one catalog operation or one API read (default 30 s).
	OpTimeout time.Duration
	// Logger receives discovery logs.
	Logger zerolog.Logger
	// WorkerID maps a pod name to its worker id; nil = HashPodName. Tests inject collisions.
	WorkerID func(podName string) uint64
	// OnReadyChange, when set, is called (from the source's goroutine, without locks held) each
	// time Ready changes.
	OnReadyChange func(ready bool)
}

// PoolStats are a PoolSource's state and counters.
type PoolStats struct {
	// Ready is true once the pool was read, its pods listed and the snapshot applied, and while
	// the pool keeps existing and being readable (epp.md §9, §11.1).
	Ready bool
	// Problem says why the source is not ready ("" when ready).
	Problem string
	// Registered is the number of workers (pods) registered; Candidates those whose pod is Ready.
	Registered, Candidates int
	// Ranks is the number of registered worker ranks (one per target port per pod).
	Ranks int
	// Applied counts snapshots applied completely; ApplyFailures those whose apply failed (each is
	// retried after RetryInterval unless a newer snapshot arrives first).
	Applied, ApplyFailures uint64
	// ReadFailures counts failed reads of the pool or its pods (retried with backoff).
	ReadFailures uint64
	// IDCollisions counts distinct (kept pod, ignored pod) pairs whose worker ids collided: the
	// younger pod is not registered while the older one lives.
	IDCollisions uint64
	// InvalidAnnotations counts distinct (pod, annotation, value) triples that were ignored.
	InvalidAnnotations uint64
	// Pending is true while a failed snapshot waits for its retry.
	Pending bool
}

// PodRank is one registered rank of a discovered pod.
type PodRank struct {
	// WorkerID and DPRank name the rank in the catalog.
	WorkerID uint64
	DPRank   uint32
	// Pod is the pod name; Address the "ip:port" Envoy sends the rank's requests to.
	Pod, Address string
	// Candidate is true when the pod's Ready condition is True.
	Candidate bool
}

// poolWorker is one pod's worker in a snapshot, with what routing needs beyond the record.
type poolWorker struct {
	desiredWorker
	pod   string
	ip    string
	ports []int32
}

// poolSnapshot is one full view of the pool: its workers, or none when the pool is missing.
type poolSnapshot struct {
	workers []poolWorker
	// ready is whether the snapshot describes a pool that exists (a missing pool deregisters
	// every pod and leaves the source not ready).
	ready   bool
	problem string
}

// rankIndex maps registered workers to their pods' addresses and ports (Ranks). Destinations come
// from the catalog records (picker.WorkerRecord.RankEndpoints), which discovery fills.
type rankIndex struct {
	byWorker map[uint64]poolWorker
}

// PoolSource keeps the worker catalog equal to the pods of one InferencePool (epp.md §10.1–10.3):
// registered workers are the pool's pods that are Running with an IP and not terminating;
// candidates are those whose Ready condition is True (readiness flaps change only candidacy, so
// KV listeners and index rows survive them); a pod recreated under the same name, re-addressed,
// or with a container restart is deleted and registered again; one dp_rank per target port. Each
// snapshot is applied as a diff, a failed apply is retried after RetryInterval unless a newer
// snapshot arrives first, and only workers this source registered are ever deleted (epp.md §11.3).
//
// The source reads through a controller-runtime client.Reader (the shared informer cache built by
// NewKube, or a fake client in tests) whenever Trigger is called. Create it with NewPoolSource,
// call Start once and Close when done. Stats, Ready and Ranks are safe for
// concurrent use.
type PoolSource struct {
	cfg    PoolConfig
	reader client.Reader
	rec    *reconciler
	log    zerolog.Logger

	trigger   chan struct{}
	readyCh   chan struct{} // closed the first time the source becomes ready
	readyOnce sync.Once
	cancel    context.CancelFunc
	done      chan struct{}
	started   bool

	mu       sync.Mutex
	stats    PoolStats
	ranks    rankIndex
	waitNote string // why no snapshot was read yet (set by the Kube layer while caches sync)

	// loop-goroutine state
	collisionsLogged map[string]bool
	annotationLogged map[string]string
}

// NewPoolSource validates cfg and returns a source reading pool and pods through reader and
// driving cat. Errors name the missing setting.
func NewPoolSource(cfg PoolConfig, reader client.Reader, cat Catalog) (*PoolSource, error) {
	switch {
	case cfg.Name == "":
		return nil, errors.New("InferencePool discovery needs the pool name (DYN_EPP_INFERENCE_POOL_NAME)")
	case cfg.Namespace == "":
		return nil, errors.New("InferencePool discovery needs the pool namespace (POD_NAMESPACE)")
	case cfg.ModelName == "":
		return nil, errors.New("InferencePool discovery needs the served model name (DYN_MODEL_NAME)")
	case cfg.BlockSize == 0:
		return nil, errors.New("InferencePool discovery needs a block size > 0 (DYN_KV_CACHE_BLOCK_SIZE)")
	case reader == nil || cat == nil:
		return nil, errors.New("InferencePool discovery needs a Kubernetes reader and a catalog")
	}
	if cfg.KVEventPort == 0 {
		cfg.KVEventPort = DefaultKVEventPort
	}
	if cfg.KVEventPort < 1 || cfg.KVEventPort > 65535 {
		return nil, fmt.Errorf("KV event port %d is out of range 1..65535 (DYN_EPP_KV_EVENT_PORT)", cfg.KVEventPort)
	}
	if cfg.KVEventReplayPort < 0 || cfg.KVEventReplayPort > 65535 {
		return nil, fmt.Errorf("KV event replay port %d is out of range 1..65535 (DYN_EPP_KV_EVENT_REPLAY_PORT)", cfg.KVEventReplayPort)
	}
	if cfg.RetryInterval <= 0 {
		cfg.RetryInterval = DefaultRetryInterval
	}
	if cfg.ReadRetryMin <= 0 {
		cfg.ReadRetryMin = time.Second
	}
	if cfg.ReadRetryMax < cfg.ReadRetryMin {
		cfg.ReadRetryMax = max(30*time.Second, cfg.ReadRetryMin)
	}
	if cfg.OpTimeout <= 0 {
		cfg.OpTimeout = 30 * time.Second
	}
	if cfg.WorkerID == nil {
		cfg.WorkerID = HashPodName
	}
	pool := cfg.Namespace + "/" + cfg.Name
	log := cfg.Logger.With().Str("component", "discovery").Str("inference_pool", pool).Logger()
	return &PoolSource{
		cfg:              cfg,
		reader:           reader,
		rec:              newReconciler(cat, log, cfg.OpTimeout, "InferencePool "+pool),
		log:              log,
		trigger:          make(chan struct{}, 1),
		readyCh:          make(chan struct{}),
		done:             make(chan struct{}),
		stats:            PoolStats{Problem: "InferencePool " + pool + " not read yet"},
		ranks:            rankIndex{byWorker: map[uint64]poolWorker{}},
		collisionsLogged: map[string]bool{},
		annotationLogged: map[string]string{},
	}, nil
}

// Trigger asks for a new snapshot: the pool and its pods are read again and applied. Calls
// coalesce (at most one read is queued); it never blocks. Informer event handlers call it.
func (s *PoolSource) Trigger() {
	select {
	case s.trigger <- struct{}{}:
	default:
	}
}

// Start starts the source's loop and returns at once. The first snapshot is read on the first
// Trigger — Kube.WatchInferencePool triggers once its informer caches have synced, so the source
// never waits on an unsynced cache; a plain client.Reader's user calls Trigger itself. The source
// becomes ready in the background (WaitReady, Ready, OnReadyChange). The loop runs until ctx ends
// or Close is called.
func (s *PoolSource) Start(ctx context.Context) error {
	if s.started {
		return errors.New("InferencePool source already started")
	}
	s.started = true
	runCtx, cancel := context.WithCancel(ctx)
	s.cancel = cancel
	go s.loop(runCtx)
	return nil
}

// Close stops the loop and waits for it. Workers stay registered (the process is exiting).
// Safe to call more than once, and before Start.
func (s *PoolSource) Close() error {
	if s.cancel == nil {
		return nil
	}
	s.cancel()
	<-s.done
	return nil
}

// WaitReady blocks until the source is ready for the first time or ctx ends (ctx's error).
func (s *PoolSource) WaitReady(ctx context.Context) error {
	select {
	case <-s.readyCh:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Ready reports whether the pool was read, its pods synced and registered, and the pool still
// exists (epp.md §9).
func (s *PoolSource) Ready() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats.Ready
}

// Stats returns the source's state and counters.
func (s *PoolSource) Stats() PoolStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.stats
	if !st.Ready && s.waitNote != "" && st.Applied == 0 {
		st.Problem = s.waitNote
	}
	return st
}

// Name returns the pool name (DYN_EPP_INFERENCE_POOL_NAME).
func (s *PoolSource) Name() string { return s.cfg.Name }

// Ranks returns every registered rank, ordered by pod name and rank.
func (s *PoolSource) Ranks() []PodRank {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []PodRank
	for id, w := range s.ranks.byWorker {
		for r, p := range w.ports {
			out = append(out, PodRank{WorkerID: id, DPRank: uint32(r), Pod: w.pod,
				Address: net.JoinHostPort(w.ip, strconv.Itoa(int(p))), Candidate: w.candidate})
		}
	}
	slices.SortFunc(out, func(a, b PodRank) int {
		if c := strings.Compare(a.Pod, b.Pod); c != 0 {
			return c
		}
		return int(a.DPRank) - int(b.DPRank)
	})
	return out
}

// SetWaitingFor records why no snapshot can be read yet (the informer caches are syncing or the
// InferencePool CRD is missing); Stats reports it as the problem until the first apply.
func (s *PoolSource) SetWaitingFor(note string) {
	s.mu.Lock()
	s.waitNote = note
	s.mu.Unlock()
}

// loop serializes reads, applies and retries.
func (s *PoolSource) loop(ctx context.Context) {
	defer close(s.done)
	retry := newRetrier[poolSnapshot](s.cfg.RetryInterval)
	defer retry.stop()
	readRetry := time.NewTimer(time.Hour)
	readRetry.Stop()
	defer readRetry.Stop()
	backoff := s.cfg.ReadRetryMin

	attempt := func(snap poolSnapshot) {
		res, err := s.rec.apply(ctx, desiredOf(snap.workers))
		if err != nil && ctx.Err() != nil {
			return
		}
		s.publish(snap, err == nil)
		if err != nil {
			s.log.Error().Err(err).Dur("retry_in", s.cfg.RetryInterval).Msg("InferencePool snapshot apply failed; will retry")
			retry.failed(snap)
			s.update(func(st *PoolStats) { st.ApplyFailures++; st.Pending = true })
			return
		}
		retry.succeeded()
		if res.upserts+res.deletes+res.reregistered+res.candidacy > 0 {
			st := s.Stats()
			s.log.Info().Int("registered", st.Registered).Int("candidates", st.Candidates).Int("upserted", res.upserts).
				Int("deleted", res.deletes).Int("reregistered", res.reregistered).Int("candidacy_changes", res.candidacy).
				Msg("InferencePool snapshot applied")
		}
	}

	for {
		select {
		case <-ctx.Done():
			return
		case <-s.trigger:
		case <-readRetry.C:
		case <-retry.C():
			if snap, ok := retry.due(); ok {
				s.log.Info().Msg("retrying InferencePool snapshot")
				attempt(snap)
			}
			continue
		}
		snap, err := s.read(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			s.readFailed(err, backoff)
			readRetry.Reset(backoff)
			backoff = min(2*backoff, s.cfg.ReadRetryMax)
			continue
		}
		if snap.ready {
			backoff = s.cfg.ReadRetryMin
			readRetry.Stop()
		} else {
			// A missing or invalid pool: informer events usually bring the fix, but poll too.
			readRetry.Reset(backoff)
			backoff = min(2*backoff, s.cfg.ReadRetryMax)
		}
		attempt(snap) // a newer snapshot supersedes a pending retry
	}
}

// desiredOf strips the routing details of a snapshot's workers.
func desiredOf(ws []poolWorker) []desiredWorker {
	out := make([]desiredWorker, len(ws))
	for i, w := range ws {
		out[i] = w.desiredWorker
	}
	return out
}

// publish records the outcome of an apply of snap: the rank index holds the workers whose record
// the catalog now has from this source; readiness follows snap.ready once an apply succeeded.
func (s *PoolSource) publish(snap poolSnapshot, applied bool) {
	idx := rankIndex{byWorker: map[uint64]poolWorker{}}
	registered, candidates, ranks := 0, 0, 0
	for _, w := range snap.workers {
		o, ok := s.rec.owned[w.rec.WorkerID]
		if !ok || !sameRecord(o.rec, w.rec) {
			continue
		}
		idx.byWorker[w.rec.WorkerID] = w
		registered++
		ranks += len(w.ports)
		if w.candidate {
			candidates++
		}
	}
	s.mu.Lock()
	s.ranks = idx
	s.stats.Registered, s.stats.Candidates, s.stats.Ranks = registered, candidates, ranks
	was := s.stats.Ready
	if applied {
		s.stats.Applied++
		s.stats.Pending = false
		s.stats.Ready, s.stats.Problem = snap.ready, snap.problem
	}
	now := s.stats.Ready
	s.mu.Unlock()
	if now && !was {
		s.readyOnce.Do(func() { close(s.readyCh) })
		s.log.Info().Int("registered", registered).Int("candidates", candidates).Msg("InferencePool synced: ready")
	}
	if now != was && s.cfg.OnReadyChange != nil {
		s.cfg.OnReadyChange(now)
	}
}

// readFailed records a failed read: the source keeps its catalog, becomes not ready and retries.
func (s *PoolSource) readFailed(err error, retryIn time.Duration) {
	problem := describeReadError(err, s.cfg.Namespace, s.cfg.Name)
	s.mu.Lock()
	s.stats.ReadFailures++
	was := s.stats.Ready
	s.stats.Ready, s.stats.Problem = false, problem
	s.mu.Unlock()
	s.log.Error().Err(err).Dur("retry_in", retryIn).Msg(problem)
	if was && s.cfg.OnReadyChange != nil {
		s.cfg.OnReadyChange(false)
	}
}

func (s *PoolSource) update(f func(*PoolStats)) {
	s.mu.Lock()
	f(&s.stats)
	s.mu.Unlock()
}

// describeReadError turns an API error into the operator-facing reason of the log line.
func describeReadError(err error, ns, name string) string {
	switch {
	case meta.IsNoMatchError(err):
		return "the InferencePool CRD (inference.networking.k8s.io/v1) is not installed; install the Gateway API Inference Extension CRDs (manifests/README.md); not ready, retrying"
	case apierrors.IsForbidden(err):
		return fmt.Sprintf("RBAC forbids reading the InferencePool or its pods in namespace %s: the EPP's ServiceAccount needs get, list and watch on pods and inferencepools (manifests/base/rbac.yaml); not ready, retrying", ns)
	case apierrors.IsUnauthorized(err):
		return "the Kubernetes API server rejected the EPP's credentials; not ready, retrying"
	}
	return fmt.Sprintf("cannot read InferencePool %s/%s or its pods; not ready, retrying", ns, name)
}

// read builds the snapshot: the pool and the pods its selector matches. A missing pool is a
// snapshot without workers that leaves the source not ready; an invalid pool spec too. API errors
// are returned.
func (s *PoolSource) read(ctx context.Context) (poolSnapshot, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.OpTimeout)
	defer cancel()
	var pool inferencev1.InferencePool
	err := s.reader.Get(ctx, types.NamespacedName{Namespace: s.cfg.Namespace, Name: s.cfg.Name}, &pool)
	if apierrors.IsNotFound(err) {
		problem := fmt.Sprintf("InferencePool %s/%s not found; not ready, waiting for it to be created", s.cfg.Namespace, s.cfg.Name)
		if s.Stats().Problem != problem {
			s.log.Error().Msg(problem)
		}
		return poolSnapshot{problem: problem}, nil
	}
	if err != nil {
		return poolSnapshot{}, err
	}
	selector, ports, problem := poolSpec(&pool)
	if problem != "" {
		problem = fmt.Sprintf("InferencePool %s/%s is invalid: %s; not ready", s.cfg.Namespace, s.cfg.Name, problem)
		if s.Stats().Problem != problem {
			s.log.Error().Msg(problem)
		}
		return poolSnapshot{problem: problem}, nil
	}
	var pods corev1.PodList
	if err := s.reader.List(ctx, &pods, client.InNamespace(s.cfg.Namespace), client.MatchingLabels(selector)); err != nil {
		return poolSnapshot{}, err
	}
	return poolSnapshot{workers: s.workersOf(pods.Items, ports), ready: true}, nil
}

// poolSpec reads the fields of epp.md §10.1: spec.selector.matchLabels (required) and
// spec.targetPorts[].number (1–8 entries, each 1..65535).
func poolSpec(pool *inferencev1.InferencePool) (map[string]string, []int32, string) {
	sel := make(map[string]string, len(pool.Spec.Selector.MatchLabels))
	for k, v := range pool.Spec.Selector.MatchLabels {
		sel[string(k)] = string(v)
	}
	if len(sel) == 0 {
		return nil, nil, "spec.selector.matchLabels is empty"
	}
	n := len(pool.Spec.TargetPorts)
	if n == 0 || n > MaxTargetPorts {
		return nil, nil, fmt.Sprintf("spec.targetPorts has %d entries, want 1..%d", n, MaxTargetPorts)
	}
	ports := make([]int32, n)
	for i, p := range pool.Spec.TargetPorts {
		if p.Number < 1 || p.Number > 65535 {
			return nil, nil, fmt.Sprintf("spec.targetPorts[%d].number %d is out of range 1..65535", i, p.Number)
		}
		ports[i] = int32(p.Number)
	}
	return sel, ports, ""
}

// workersOf turns the selected pods into workers (epp.md §10.2, §10.3). Pods that are not
// registered (not Running, no IP, terminating) are left out; of pods sharing a worker id the
// oldest is kept and the collision logged.
func (s *PoolSource) workersOf(pods []corev1.Pod, ports []int32) []poolWorker {
	byID := make(map[uint64]*corev1.Pod, len(pods))
	for i := range pods {
		p := &pods[i]
		if p.Status.Phase != corev1.PodRunning || p.Status.PodIP == "" || p.DeletionTimestamp != nil {
			continue
		}
		id := s.cfg.WorkerID(p.Name)
		other, clash := byID[id]
		if !clash {
			byID[id] = p
			continue
		}
		keep, drop := other, p
		if olderPod(p, other) {
			keep, drop = p, other
		}
		byID[id] = keep
		key := keep.Name + "\x00" + drop.Name
		if !s.collisionsLogged[key] {
			s.collisionsLogged[key] = true
			s.update(func(st *PoolStats) { st.IDCollisions++ })
			s.log.Error().Uint64("worker_id", id).Str("kept_pod", keep.Name).Str("ignored_pod", drop.Name).
				Msg("two pods of the pool hash to the same worker id; keeping the older pod, the other is not registered")
		}
	}
	out := make([]poolWorker, 0, len(byID))
	for id, p := range byID {
		out = append(out, s.workerOf(id, p, ports))
	}
	slices.SortFunc(out, func(a, b poolWorker) int { return strings.Compare(a.pod, b.pod) })
	return out
}

// olderPod reports whether a was created before b (ties: the smaller UID, then name).
func olderPod(a, b *corev1.Pod) bool {
	ta, tb := a.CreationTimestamp.Time, b.CreationTimestamp.Time
	if !ta.Equal(tb) {
		return ta.Before(tb)
	}
	if a.UID != b.UID {
		return a.UID < b.UID
	}
	return a.Name < b.Name
}

// workerOf is the worker record of one registered pod (epp.md §10.3).
func (s *PoolSource) workerOf(id uint64, p *corev1.Pod, ports []int32) poolWorker {
	ip := p.Status.PodIP
	if parsed := net.ParseIP(ip); parsed != nil {
		ip = parsed.String()
	}
	bs := s.cfg.BlockSize
	size := uint32(len(ports))
	start := uint32(0)
	kvPort := s.annotatedInt(p, AnnotationKVEventPort, s.cfg.KVEventPort, 65535)
	if raw, annotated := p.Annotations[AnnotationKVEventPort]; annotated && kvPort != s.cfg.KVEventPort && kvPort+len(ports)-1 > 65535 {
		s.invalidAnnotation(p, AnnotationKVEventPort, raw, fmt.Sprintf("ranks up to %d would publish above port 65535", len(ports)-1))
		kvPort = s.cfg.KVEventPort
	}
	if kvPort+len(ports)-1 > 65535 {
		// The pool-wide setting itself overflows for this many ranks: the endpoints are invalid
		// and the worker stays unschedulable; say so once per rank count, naming the setting.
		if lk := "\x00setting\x00" + strconv.Itoa(len(ports)); s.annotationLogged[lk] == "" {
			s.annotationLogged[lk] = "logged"
			s.log.Error().Int("kv_event_port", kvPort).Int("ranks", len(ports)).
				Msg("DYN_EPP_KV_EVENT_PORT plus the pool's rank count exceeds port 65535: pods with this many target ports get no valid KV-event endpoints")
		}
	}
	rec := picker.WorkerRecord{
		WorkerID:              id,
		ModelName:             s.cfg.ModelName,
		RoutingGroup:          picker.DefaultPartitionName,
		Endpoint:              "http://" + net.JoinHostPort(ip, strconv.Itoa(int(ports[0]))),
		BlockSize:             &bs,
		DataParallelStartRank: &start,
		DataParallelSize:      &size,
		KVEventsEndpoints:     make(map[string]string, len(ports)),
	}
	for r := range ports {
		rec.KVEventsEndpoints[strconv.Itoa(r)] = "tcp://" + net.JoinHostPort(ip, strconv.Itoa(kvPort+r))
	}
	if len(ports) > 1 {
		// Rank r is served on targetPorts[r]: the catalog carries it, so ext_proc and the
		// selection API name the same destination (and both follow an API rewrite).
		rec.RankEndpoints = make([]string, len(ports))
		for r, p := range ports {
			rec.RankEndpoints[r] = "http://" + net.JoinHostPort(ip, strconv.Itoa(int(p)))
		}
	}
	if s.cfg.KVEventReplayPort > 0 && len(ports) == 1 {
		rec.ReplayEndpoint = "tcp://" + net.JoinHostPort(ip, strconv.Itoa(s.cfg.KVEventReplayPort))
	}
	if v := s.annotatedUint(p, AnnotationMaxNumBatchedTokens, s.cfg.MaxNumBatchedTokens); v > 0 {
		rec.MaxNumBatchedTokens = &v
	}
	if v := s.annotatedUint(p, AnnotationTotalKVBlocks, s.cfg.TotalKVBlocks); v > 0 {
		rec.TotalKVBlocks = &v
	}
	return poolWorker{
		desiredWorker: desiredWorker{rec: rec, incarnation: incarnation(p, ip), candidate: podReady(p)},
		pod:           p.Name,
		ip:            ip,
		ports:         ports,
	}
}

// incarnation identifies the process behind a pod: UID, IP and every container's restart count
// (epp.md §10.2). Any change re-registers the worker.
func incarnation(p *corev1.Pod, ip string) string {
	var b strings.Builder
	b.WriteString(string(p.UID))
	b.WriteByte('|')
	b.WriteString(ip)
	statuses := slices.Clone(p.Status.ContainerStatuses)
	slices.SortFunc(statuses, func(a, b corev1.ContainerStatus) int { return strings.Compare(a.Name, b.Name) })
	for _, c := range statuses {
		fmt.Fprintf(&b, "|%s=%d", c.Name, c.RestartCount)
	}
	return b.String()
}

// podReady reports whether the pod's Ready condition is True.
func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// annotatedUint returns the pod's positive integer annotation key, or def when absent or invalid.
func (s *PoolSource) annotatedUint(p *corev1.Pod, key string, def uint64) uint64 {
	raw, ok := p.Annotations[key]
	if !ok {
		return def
	}
	v, err := strconv.ParseUint(strings.TrimSpace(raw), 10, 64)
	if err != nil || v == 0 || v > 1<<53 {
		s.invalidAnnotation(p, key, raw, "want a whole number in 1..9007199254740992 (2^53)")
		return def
	}
	return v
}

// annotatedInt returns the pod's integer annotation key in 1..hi, or def when absent or invalid.
func (s *PoolSource) annotatedInt(p *corev1.Pod, key string, def, hi int) int {
	raw, ok := p.Annotations[key]
	if !ok {
		return def
	}
	v, err := strconv.Atoi(strings.TrimSpace(raw))
	if err != nil || v < 1 || v > hi {
		s.invalidAnnotation(p, key, raw, fmt.Sprintf("want an integer in 1..%d", hi))
		return def
	}
	return v
}

// invalidAnnotation counts an ignored annotation and logs it once per pod, key and value.
func (s *PoolSource) invalidAnnotation(p *corev1.Pod, key, raw, why string) {
	lk := p.Name + "\x00" + key
	if v, seen := s.annotationLogged[lk]; seen && v == raw {
		return
	}
	s.annotationLogged[lk] = raw
	s.update(func(st *PoolStats) { st.InvalidAnnotations++ })
	s.log.Warn().Str("pod", p.Name).Str("annotation", key).Str("value", raw).
		Msgf("ignoring invalid pod annotation (%s); using the pool-wide setting", why)
}
