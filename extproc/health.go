package extproc

import (
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthgrpc "google.golang.org/grpc/health/grpc_health_v1"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// Health service names of epp.md §9.
const (
	// HealthLiveness is SERVING while the process runs, including during drain.
	HealthLiveness = "liveness"
	// HealthReadiness is SERVING when ready and not draining.
	HealthReadiness = "readiness"
	// HealthOverall is the overall service name "" (same as readiness).
	HealthOverall = ""
	// HealthExtProc is the service name Envoy health-checks (same as readiness).
	HealthExtProc = "envoy.service.ext_proc.v3.ExternalProcessor"
	// HealthInferenceExtension is an alias of readiness used by Gateway API Inference Extension tooling.
	HealthInferenceExtension = "inference-extension"
)

// readinessServices are the names that follow readiness.
var readinessServices = []string{HealthReadiness, HealthOverall, HealthExtProc, HealthInferenceExtension}

// Health is the grpc.health.v1.Health service of epp.md §9 (Check and Watch). liveness is SERVING
// from construction; the readiness names are SERVING exactly when SetReady(true) was called and
// Drain was not. Unknown service names: Check → gRPC NOT_FOUND, Watch → SERVICE_UNKNOWN. Register the
// same Health on the health port's and the ext_proc port's grpc.Server. Safe for concurrent use.
type Health struct {
	srv *health.Server

	mu       sync.Mutex
	ready    bool
	draining bool
}

// NewHealth returns a Health with liveness SERVING and every readiness name NOT_SERVING.
func NewHealth() *Health {
	h := &Health{srv: health.NewServer()}
	h.srv.SetServingStatus(HealthLiveness, healthpb.HealthCheckResponse_SERVING)
	h.apply()
	return h
}

// Register registers the health service on g. Call it once per grpc.Server.
func (h *Health) Register(g *grpc.Server) { healthgrpc.RegisterHealthServer(g, h.srv) }

// Server returns the underlying grpc.health.v1 server implementation.
func (h *Health) Server() healthgrpc.HealthServer { return h.srv }

// SetReady records whether the EPP is ready (epp.md §9: pool read, pods synced, recovery finished,
// core running); readiness names are SERVING when ready and not draining.
func (h *Health) SetReady(ready bool) {
	h.mu.Lock()
	h.ready = ready
	h.apply()
	h.mu.Unlock()
}

// Drain starts graceful shutdown: readiness names go NOT_SERVING and stay so; liveness stays SERVING.
// Existing and new streams keep being served (the caller stops the servers after its drain window).
func (h *Health) Drain() {
	h.mu.Lock()
	h.draining = true
	h.apply()
	h.mu.Unlock()
}

// Ready reports whether SetReady(true) was called, regardless of draining: the condition for
// serving requests (draining EPPs still serve, epp.md §9). Pass h.Ready as Config.Ready.
func (h *Health) Ready() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.ready
}

// Draining reports whether Drain was called.
func (h *Health) Draining() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.draining
}

// apply pushes the readiness status to the underlying server.
func (h *Health) apply() {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if h.ready && !h.draining {
		st = healthpb.HealthCheckResponse_SERVING
	}
	for _, name := range readinessServices {
		h.srv.SetServingStatus(name, st)
	}
}
