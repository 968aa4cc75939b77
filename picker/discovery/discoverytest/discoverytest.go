// Package discoverytest starts a real Kubernetes API server for tests of Kubernetes discovery:
// controller-runtime's envtest with the kube-apiserver and etcd binaries in KUBEBUILDER_ASSETS
// (prepared by ../shared/tools/envtest-assets.sh; scripts/test.sh sets the variable when the
// assets exist), with the InferencePool CRD of the gateway-api-inference-extension module kvepp
// builds against. Without KUBEBUILDER_ASSETS the test is skipped with a message saying so.
package discoverytest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// InferencePoolCRDDir returns the directory holding the InferencePool CRD in the module cache.
// It fails t when the module or the file is missing.
func InferencePoolCRDDir(t testing.TB) string {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/gateway-api-inference-extension").Output()
	if err != nil {
		t.Fatalf("locate the gateway-api-inference-extension module: %v", err)
	}
	dir := filepath.Join(strings.TrimSpace(string(out)), "config", "crd", "bases")
	if _, err := os.Stat(filepath.Join(dir, "inference.networking.k8s.io_inferencepools.yaml")); err != nil {
		t.Fatalf("InferencePool CRD not found: %v", err)
	}
	return dir
}

// Start starts an envtest control plane (stopped when the test ends), with the InferencePool CRD
// installed when withCRD is true, or skips t when KUBEBUILDER_ASSETS is not set.
func Start(t testing.TB, withCRD bool) *envtest.Environment {
	t.Helper()
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		t.Skip("KUBEBUILDER_ASSETS is not set: no kube-apiserver/etcd for envtest " +
			"(prepare them with ../shared/tools/envtest-assets.sh DIR and export KUBEBUILDER_ASSETS=DIR; " +
			"scripts/test.sh does this when the assets exist)")
	}
	env := &envtest.Environment{ErrorIfCRDPathMissing: true}
	if withCRD {
		env.CRDDirectoryPaths = []string{InferencePoolCRDDir(t)}
	}
	start := time.Now()
	if _, err := env.Start(); err != nil {
		t.Fatalf("start envtest control plane: %v", err)
	}
	t.Logf("envtest control plane started in %v", time.Since(start).Round(time.Millisecond))
	t.Cleanup(func() {
		if err := env.Stop(); err != nil {
			t.Errorf("stop envtest: %v", err)
		}
	})
	return env
}
