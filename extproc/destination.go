package extproc

import (
	"fmt"
	"net"
	"net/url"
	"strings"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvepp/kvepp/picker"
)

// Metadata namespaces and keys of the endpoint-picker protocol (epp.md §5.8, §5.9, §6.1).
const (
	// DestinationHeader carries the chosen endpoint(s) "ip:port[,ip:port…]" to Envoy's ORIGINAL_DST
	// cluster.
	DestinationHeader = "x-gateway-destination-endpoint"
	// LBMetadataNamespace is the dynamic-metadata namespace of the destination ("envoy.lb").
	LBMetadataNamespace = "envoy.lb"
	// SubsetHintNamespace is the request-phase filter-metadata namespace of the subset hint.
	SubsetHintNamespace = "envoy.lb.subset_hint"
	// SubsetHintKey is the subset hint's key: a list of "ip:port" strings or one comma-separated string.
	SubsetHintKey = "x-gateway-destination-endpoint-subset"
	// ServedEndpointKey is the response-phase envoy.lb key naming the endpoint that actually served.
	ServedEndpointKey = "x-gateway-destination-endpoint-served"
	// DecisionMetadataNamespace is the dynamic-metadata namespace in which the routing reply
	// describes the decision when the request carries DecisionHeader, for access logs and `epp
	// route`: "booked" (bool), and for a booked pick "matched_tokens" (the chosen worker's
	// longest_matched) and "prompt_tokens".
	DecisionMetadataNamespace = "kvepp.decision"
	// DecisionHeader is the request header ("x-kvepp-decision", any non-empty value) that asks for
	// the DecisionMetadataNamespace metadata. It is removed from the forwarded request. Opt-in, so
	// the routing reply of ordinary requests stays as small as the protocol needs.
	DecisionHeader = "x-kvepp-decision"
)

// endpointHostPort turns a worker endpoint URL ("http://10.0.0.1:8000", "http://[::1]:8000", or a
// bare "host:port") into "host:port" with IPv6 hosts bracketed. A URL without a port gets its
// scheme's default (80 / 443). It errors on an empty or unparseable endpoint.
func endpointHostPort(endpoint string) (string, error) {
	if endpoint == "" {
		return "", fmt.Errorf("worker endpoint is empty")
	}
	if !strings.Contains(endpoint, "://") {
		host, port, err := net.SplitHostPort(endpoint)
		if err != nil {
			return "", fmt.Errorf("worker endpoint %q: %w", endpoint, err)
		}
		return net.JoinHostPort(host, port), nil
	}
	u, err := url.Parse(endpoint)
	if err != nil {
		return "", fmt.Errorf("worker endpoint %q: %w", endpoint, err)
	}
	host, port := u.Hostname(), u.Port()
	if host == "" {
		return "", fmt.Errorf("worker endpoint %q has no host", endpoint)
	}
	if port == "" {
		switch u.Scheme {
		case "https":
			port = "443"
		default:
			port = "80"
		}
	}
	return net.JoinHostPort(host, port), nil
}

// destinationValue builds the header value of epp.md §5.9: the primary, then each fallback, comma
// joined; each rank at the host:port of its endpoint (rankAddress).
func (s *Server) destinationValue(sel *picker.Selection) (string, error) {
	primary, err := s.rankAddress(sel.Endpoint)
	if err != nil {
		return "", fmt.Errorf("worker %d dp_rank %d: %w", sel.WorkerID, sel.DPRank, err)
	}
	if len(sel.Fallbacks) == 0 {
		return primary, nil
	}
	var b strings.Builder
	b.WriteString(primary)
	for _, f := range sel.Fallbacks {
		hp, err := s.rankAddress(f.Endpoint)
		if err != nil {
			continue // an unusable fallback is dropped; the primary is what matters
		}
		b.WriteByte(',')
		b.WriteString(hp)
	}
	return b.String(), nil
}

// normalizeHost returns the canonical text of an IP host (brackets stripped, IPv6 compressed), or
// the trimmed lower-case input when it is not an IP.
func normalizeHost(h string) string {
	h = strings.TrimSuffix(strings.TrimPrefix(strings.TrimSpace(h), "["), "]")
	if ip := net.ParseIP(h); ip != nil {
		return ip.String()
	}
	return strings.ToLower(h)
}

// hintHost extracts the host of one subset-hint entry ("ip:port", "[v6]:port", or a bare IP).
func hintHost(entry string) string {
	entry = strings.TrimSpace(entry)
	if entry == "" {
		return ""
	}
	if host, _, err := net.SplitHostPort(entry); err == nil {
		return normalizeHost(host)
	}
	return normalizeHost(entry)
}

// subsetHint reads the subset hint of epp.md §5.8 from request-phase filter metadata. present is
// false when the namespace or key is absent (no restriction). hosts are the normalised hosts of the
// usable entries; non-string list entries and blanks are skipped, so present with no hosts means
// "no candidates".
func subsetHint(md map[string]*structpb.Struct) (hosts []string, present bool) {
	ns, ok := md[SubsetHintNamespace]
	if !ok || ns == nil {
		return nil, false
	}
	v, ok := ns.GetFields()[SubsetHintKey]
	if !ok || v == nil {
		return nil, false
	}
	add := func(s string) {
		for _, part := range strings.Split(s, ",") {
			if h := hintHost(part); h != "" {
				hosts = append(hosts, h)
			}
		}
	}
	switch k := v.GetKind().(type) {
	case *structpb.Value_StringValue:
		add(k.StringValue)
	case *structpb.Value_ListValue:
		for _, e := range k.ListValue.GetValues() {
			if s, ok := e.GetKind().(*structpb.Value_StringValue); ok {
				add(s.StringValue)
			}
		}
	}
	return hosts, true
}

// allowedWorkers maps hint hosts to the ids of the given workers whose endpoint host matches (ports
// ignored). Unknown hosts are ignored; the result has no duplicates.
func allowedWorkers(hosts []string, workers []picker.WorkerState) []uint64 {
	if len(hosts) == 0 {
		return nil
	}
	want := make(map[string]struct{}, len(hosts))
	for _, h := range hosts {
		want[h] = struct{}{}
	}
	var ids []uint64
	seen := make(map[uint64]struct{})
	for i := range workers {
		w := &workers[i]
		hp, err := endpointHostPort(w.Endpoint)
		if err != nil {
			continue
		}
		host, _, _ := net.SplitHostPort(hp)
		if _, ok := want[normalizeHost(host)]; !ok {
			continue
		}
		if _, dup := seen[w.WorkerID]; dup {
			continue
		}
		seen[w.WorkerID] = struct{}{}
		ids = append(ids, w.WorkerID)
	}
	return ids
}

// lbMetadata is the dynamic metadata {"envoy.lb": {"x-gateway-destination-endpoint": dest}}.
func lbMetadata(dest string) *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		LBMetadataNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			DestinationHeader: structpb.NewStringValue(dest),
		}}),
	}}
}

// decisionMetadata is the DecisionMetadataNamespace value of a routing reply.
func decisionMetadata(d *decision) *structpb.Value {
	f := map[string]*structpb.Value{"booked": structpb.NewBoolValue(d.booked)}
	if d.booked {
		f["matched_tokens"] = structpb.NewNumberValue(float64(d.sel.Overlap.LongestMatched))
		f["prompt_tokens"] = structpb.NewNumberValue(float64(d.sel.ISLTokens))
	}
	return structpb.NewStructValue(&structpb.Struct{Fields: f})
}

// splitHostPort is net.SplitHostPort.
func splitHostPort(hp string) (host, port string, err error) { return net.SplitHostPort(hp) }
