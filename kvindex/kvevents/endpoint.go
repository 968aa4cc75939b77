package kvevents

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
)

// ValidateEndpoint checks that ep is a ZeroMQ endpoint a SUB or DEALER socket can connect to
// (kv-events-index.md §5.1): "tcp://host:port" with a non-wildcard host and a port in 1..65535
// (IPv6 hosts in brackets), "ipc://path" or "inproc://name" with a non-empty path or name. The
// error names what is wrong.
func ValidateEndpoint(ep string) error {
	scheme, rest, ok := strings.Cut(ep, "://")
	if !ok {
		return fmt.Errorf("%q has no scheme (want tcp://host:port, ipc://path or inproc://name)", ep)
	}
	switch scheme {
	case "tcp":
		host, port, err := net.SplitHostPort(rest)
		if err != nil {
			return fmt.Errorf("%q: %w", ep, err)
		}
		if host == "" || host == "*" || host == "0.0.0.0" || host == "::" {
			return fmt.Errorf("%q: host %q cannot be connected to", ep, host)
		}
		if _, err := parsePort(port); err != nil {
			return fmt.Errorf("%q: %w", ep, err)
		}
		return nil
	case "ipc", "inproc":
		if rest == "" {
			return fmt.Errorf("%q: empty %s address", ep, scheme)
		}
		return nil
	}
	return fmt.Errorf("%q: unsupported scheme %q (want tcp, ipc or inproc)", ep, scheme)
}

func parsePort(port string) (int, error) {
	p, err := strconv.Atoi(port)
	if err != nil || p < 1 || p > 65535 {
		return 0, fmt.Errorf("port %q is not in 1..65535", port)
	}
	return p, nil
}

// OffsetEndpoint returns the endpoint of data-parallel rank rank derived from a base endpoint the
// way engines derive it (kv-events-index.md §5.1): tcp adds rank to the port, ipc and inproc
// append "_dp{rank}". The base must be valid (ValidateEndpoint); a tcp port pushed above 65535
// is an error.
func OffsetEndpoint(base string, rank uint32) (string, error) {
	if err := ValidateEndpoint(base); err != nil {
		return "", err
	}
	scheme, rest, _ := strings.Cut(base, "://")
	if scheme != "tcp" {
		return fmt.Sprintf("%s_dp%d", base, rank), nil
	}
	host, port, _ := net.SplitHostPort(rest)
	p, _ := parsePort(port)
	if uint64(p)+uint64(rank) > 65535 {
		return "", fmt.Errorf("%q: port %d + dp_rank %d exceeds 65535", base, p, rank)
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(p+int(rank))), nil
}

// ErrMissingEndpoint is wrapped by Manager.Attach when a rank in the worker's range has no
// kv_events endpoint.
var ErrMissingEndpoint = errors.New("kv_events endpoint is required")

// rankEndpoints are the resolved, validated endpoints of one rank.
type rankEndpoints struct {
	events, replay string
}

// resolveEndpoints returns the endpoints of every rank in spec's range, or the first error.
func (spec WorkerSpec) resolveEndpoints() (map[uint32]rankEndpoints, error) {
	out := make(map[uint32]rankEndpoints, spec.DPSize)
	for i := uint32(0); i < spec.DPSize; i++ {
		r := spec.DPStartRank + i
		ep, ok := spec.Endpoints[r]
		switch {
		case ok:
		case spec.Endpoint != "" && spec.DPSize == 1:
			ep = spec.Endpoint
		case spec.Endpoint != "":
			var err error
			if ep, err = OffsetEndpoint(spec.Endpoint, r); err != nil {
				return nil, fmt.Errorf("invalid kv_events endpoint for worker %d dp_rank %d: %w", spec.WorkerID, r, err)
			}
		default:
			return nil, fmt.Errorf("worker %d: %w for dp_rank %d", spec.WorkerID, ErrMissingEndpoint, r)
		}
		if err := ValidateEndpoint(ep); err != nil {
			return nil, fmt.Errorf("invalid kv_events endpoint for worker %d dp_rank %d: %w", spec.WorkerID, r, err)
		}
		rep := spec.ReplayEndpoint
		if rep != "" && spec.DPSize > 1 {
			var err error
			if rep, err = OffsetEndpoint(spec.ReplayEndpoint, r); err != nil {
				return nil, fmt.Errorf("invalid replay endpoint for worker %d dp_rank %d: %w", spec.WorkerID, r, err)
			}
		}
		if rep != "" {
			if err := ValidateEndpoint(rep); err != nil {
				return nil, fmt.Errorf("invalid replay endpoint for worker %d dp_rank %d: %w", spec.WorkerID, r, err)
			}
		}
		out[r] = rankEndpoints{events: ep, replay: rep}
	}
	return out, nil
}
