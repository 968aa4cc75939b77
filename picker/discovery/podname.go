package discovery

import sip13 "github.com/dgryski/go-sip13"

// workerIDMask keeps the low 53 bits of a pod-name hash, so every worker id is exactly
// representable as a JSON number in clients that decode into float64.
const workerIDMask = 0x001F_FFFF_FFFF_FFFF

// HashPodName is the worker id of a pod (epp.md §10.3 hash_pod_name): SipHash-1-3 with keys (0, 0)
// over the pod name's UTF-8 bytes followed by one 0xFF byte, masked to 53 bits. The trailing 0xFF
// is what Rust's Hash for str writes, so the ids equal those of the upstream EPP for the same pod
// names ("vllm-0" → 1943803597606491).
func HashPodName(name string) uint64 {
	b := make([]byte, len(name)+1)
	copy(b, name)
	b[len(name)] = 0xFF
	return sip13.Sum64(0, 0, b) & workerIDMask
}
