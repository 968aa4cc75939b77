package extproc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvepp/kvepp/picker"
)

// Defaults of Config (epp.md §2).
const (
	// DefaultMaxRequestBodyBytes is DYN_EPP_MAX_REQUEST_BODY_BYTES' default: 64 MiB.
	DefaultMaxRequestBodyBytes = 64 << 20
	// DefaultMaxInflight is DYN_EPP_MAX_INFLIGHT_REQUESTS' default.
	DefaultMaxInflight = 1024
	// DefaultMaxDestinations is DYN_EPP_MAX_DESTINATIONS' default (primary only).
	DefaultMaxDestinations = 1
	// DefaultReleaseTimeout bounds a Free or PrefillComplete call made after the stream has gone.
	DefaultReleaseTimeout = 5 * time.Second
	// MaxStreamedChunkBytes is the largest re-streamed request body chunk (epp.md §4.1 item 3).
	MaxStreamedChunkBytes = 62000
	// MaxSessionIDBytes is the longest accepted x-dynamo-session-id / parent session id (epp.md §8).
	MaxSessionIDBytes = 256
	// DefaultRequestBodyTimeout is DYN_EPP_REQUEST_BODY_TIMEOUT_SECS' default: 60 s.
	DefaultRequestBodyTimeout = 60 * time.Second
)

// Config configures a Server. Picker and Tokenizers are required; zero values of the other fields
// take the documented defaults.
type Config struct {
	// Picker is the selection core (*picker.Service in production).
	Picker Picker
	// Tokenizers turns prompts into token ids per model (epp.md §5.4).
	Tokenizers Tokenizers
	// ModelName is DYN_MODEL_NAME: the partition model of discovered workers, used when the body's
	// model is not a partition model (it is then the LoRA name) or absent (epp.md §5.5). May be "".
	ModelName string
	// RoutingGroup is the partition routing group of every request; "" means picker.DefaultPartitionName.
	RoutingGroup string
	// MaxRequestBodyBytes is DYN_EPP_MAX_REQUEST_BODY_BYTES: larger bodies get 413 (default 64 MiB).
	MaxRequestBodyBytes int64
	// MaxInflight is DYN_EPP_MAX_INFLIGHT_REQUESTS: requests allowed in the routing phase at once;
	// more get 429 (default 1024).
	MaxInflight int
	// MaxDestinations is DYN_EPP_MAX_DESTINATIONS: the length of the destination list (primary plus
	// unbooked fallbacks, epp.md §5.9; default 1).
	MaxDestinations int
	// Ready reports whether the EPP is ready to route (epp.md §5.6 step 2, §9); false → 503. Nil means
	// always ready. Health.Ready fits.
	Ready func() bool
	// Metrics receives the server's metrics; nil → a fresh NewMetrics() (read it with Server.Metrics).
	Metrics *Metrics
	// Logger receives per-request debug logs and warnings; the zero value logs nothing.
	Logger zerolog.Logger
	// ReleaseTimeout bounds Free and PrefillComplete calls made after the stream context ended
	// (default DefaultReleaseTimeout).
	ReleaseTimeout time.Duration
	// RequestBodyTimeout is DYN_EPP_REQUEST_BODY_TIMEOUT_SECS: how long a request may take from its
	// headers to the end of its body before it is answered 408 (default
	// DefaultRequestBodyTimeout).
	RequestBodyTimeout time.Duration

	// ConformanceTestHooks enables the Gateway API Inference Extension conformance-suite hooks
	// (DYN_EPP_CONFORMANCE_TEST_HOOKS): the test-epp-endpoint-selection request header restricts
	// the candidates, and the response headers reply sets x-conformance-test-served-endpoint,
	// x-conformance-test-selected-endpoint and x-conformance-test-epp-pool. Test clusters only:
	// any client could steer its requests with the header.
	ConformanceTestHooks bool
	// PoolName is the InferencePool as "namespace/name", reported by the conformance hooks.
	PoolName string
}

// Server is the ext_proc v3 ExternalProcessor (epp.md §4–§8). Create it with NewServer and register
// it with Register; it is safe for concurrent streams.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer

	cfg     Config
	group   string
	metrics *Metrics
	log     zerolog.Logger

	inflight atomic.Int64
	bufPool  sync.Pool

	// destMD is destinationMetadata's cache of routing-reply metadata; rankAddrs rankAddress's
	// of worker endpoints' host:port.
	destMD    keyCache[*structpb.Struct]
	rankAddrs keyCache[string]
}

var _ extprocv3.ExternalProcessorServer = (*Server)(nil)

// NewServer validates cfg, applies defaults and returns a Server. It errors when Picker or Tokenizers
// is nil or a limit is negative.
func NewServer(cfg Config) (*Server, error) {
	if cfg.Picker == nil {
		return nil, errors.New("extproc: Config.Picker is required")
	}
	if cfg.Tokenizers == nil {
		return nil, errors.New("extproc: Config.Tokenizers is required")
	}
	if cfg.MaxRequestBodyBytes < 0 {
		return nil, fmt.Errorf("extproc: MaxRequestBodyBytes %d must be > 0", cfg.MaxRequestBodyBytes)
	}
	if cfg.MaxInflight < 0 {
		return nil, fmt.Errorf("extproc: MaxInflight %d must be > 0", cfg.MaxInflight)
	}
	if cfg.MaxDestinations < 0 {
		return nil, fmt.Errorf("extproc: MaxDestinations %d must be > 0", cfg.MaxDestinations)
	}
	if cfg.RequestBodyTimeout < 0 {
		return nil, fmt.Errorf("extproc: RequestBodyTimeout %v must be > 0", cfg.RequestBodyTimeout)
	}
	if cfg.MaxRequestBodyBytes == 0 {
		cfg.MaxRequestBodyBytes = DefaultMaxRequestBodyBytes
	}
	if cfg.MaxInflight == 0 {
		cfg.MaxInflight = DefaultMaxInflight
	}
	if cfg.MaxDestinations == 0 {
		cfg.MaxDestinations = DefaultMaxDestinations
	}
	if cfg.ReleaseTimeout <= 0 {
		cfg.ReleaseTimeout = DefaultReleaseTimeout
	}
	if cfg.RequestBodyTimeout == 0 {
		cfg.RequestBodyTimeout = DefaultRequestBodyTimeout
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics()
	}
	s := &Server{cfg: cfg, group: cfg.RoutingGroup, metrics: cfg.Metrics, log: cfg.Logger}
	if s.group == "" {
		s.group = picker.DefaultPartitionName
	}
	s.bufPool.New = func() any { b := make([]byte, 0, 32<<10); return &b }
	return s, nil
}

// Register registers the ExternalProcessor service on g.
func (s *Server) Register(g *grpc.Server) { extprocv3.RegisterExternalProcessorServer(g, s) }

// Metrics returns the server's metrics.
func (s *Server) Metrics() *Metrics { return s.metrics }

// GRPCServerOptions returns the grpc.ServerOptions the ext_proc port needs: a maximum receive message
// size of MaxRequestBodyBytes + 1 MiB, since BUFFERED mode delivers the whole body in one message
// (epp.md §1); transport settings for request bodies of hundreds of kilobytes arriving on many
// concurrent streams of one proxy connection (see streamWindowBytes); and replyCodec, which
// encodes replies with go-control-plane's generated vtprotobuf code when built with -tags
// vtprotobuf.
func (s *Server) GRPCServerOptions() []grpc.ServerOption {
	n := s.cfg.MaxRequestBodyBytes + 1<<20
	if n > int64(^uint32(0)>>1) {
		n = int64(^uint32(0) >> 1)
	}
	return []grpc.ServerOption{
		grpc.MaxRecvMsgSize(int(n)),
		grpc.InitialWindowSize(streamWindowBytes),
		grpc.InitialConnWindowSize(connWindowBytes),
		grpc.NumStreamWorkers(uint32(streamWorkersPerCPU * runtime.GOMAXPROCS(0))),
		codecOption(),
	}
}

// Transport settings of the ext_proc port. A request body is streamed to kvepp in one go and
// answered only at its end, so the HTTP/2 flow-control window of a stream is sized for a whole
// prompt-sized body (a 225 KB conversation would otherwise wait for window updates three times),
// and the connection's for many of them.
//
// Stream workers are goroutines gRPC keeps to run new streams on. A stream that finds every worker
// busy gets a new goroutine, whose small stack is grown (copied) twice on the way through the
// tokenizer — 2.5 % of kvepp's CPU at 8 concurrent 12 KB chats when there were 2 per CPU, half of
// the streams missing a worker. A stream holds its worker for the whole exchange, response
// included, so the workers are sized for many streams in flight: an idle worker is a parked
// goroutine whose stack the garbage collector shrinks back.
const (
	streamWindowBytes   = 1 << 20
	connWindowBytes     = 16 << 20
	streamWorkersPerCPU = 32
)

// Process implements the ext_proc bidirectional stream: one HTTP request per stream (epp.md §4.4).
// It returns a gRPC FAILED_PRECONDITION error for unsupported protocol configurations
// (observability_mode, STREAMED or BUFFERED_PARTIAL request bodies); every request-level failure is
// an ImmediateResponse instead. A booking made on the stream is freed exactly once on every path.
func (s *Server) Process(ps extprocv3.ExternalProcessor_ProcessServer) error {
	st := newStream(s, ps)
	clean := false
	defer func() {
		st.mu.Lock()
		defer st.mu.Unlock()
		st.finish(clean)
	}()
	// One request message is decoded into for the whole stream: decoding resets it first
	// (proto.Unmarshal), and the stream keeps only the nested messages of a request (a body chunk,
	// filter metadata), which every decode allocates anew — never the message itself.
	req := &extprocv3.ProcessingRequest{}
	for {
		err := ps.RecvMsg(req)
		if err != nil {
			if errors.Is(err, io.EOF) {
				clean = true
				return nil
			}
			return err
		}
		st.mu.Lock()
		err = st.handle(req)
		st.mu.Unlock()
		if err != nil {
			return err
		}
	}
}

// getBuf returns an empty pooled body buffer.
func (s *Server) getBuf() *[]byte {
	b := s.bufPool.Get().(*[]byte)
	*b = (*b)[:0]
	return b
}

// putBuf returns a buffer to the pool unless it grew beyond 4 MiB.
func (s *Server) putBuf(b *[]byte) {
	if cap(*b) <= 4<<20 {
		s.bufPool.Put(b)
	}
}

// releaseCtx is the context for Free / PrefillComplete calls: the stream's values without its
// cancellation, bounded by ReleaseTimeout.
func (s *Server) releaseCtx(parent context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(parent), s.cfg.ReleaseTimeout)
}
