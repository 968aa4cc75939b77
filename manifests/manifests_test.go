// Package manifests holds no Go code: it is the kustomize tree of manifests/ (README.md), and this
// test renders every kustomization and checks the objects against kvepp itself.
package manifests

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	inferencev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/internal/sharedtest"
	"github.com/kvepp/kvepp/picker/discovery"
	"github.com/kvepp/kvepp/runner"
)

// destinationRule mirrors the fields of Istio's networking.istio.io/v1 DestinationRule that the
// overlays use (Istio's Go API module is not a dependency); strict decoding still rejects any
// other field.
type destinationRule struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name      string            `json:"name"`
		Namespace string            `json:"namespace"`
		Labels    map[string]string `json:"labels,omitempty"`
	} `json:"metadata"`
	Spec struct {
		Host          string `json:"host"`
		TrafficPolicy struct {
			TLS struct {
				Mode               string `json:"mode"`
				InsecureSkipVerify bool   `json:"insecureSkipVerify,omitempty"`
			} `json:"tls"`
		} `json:"trafficPolicy"`
	} `json:"spec"`
}

// rendered is one kustomization's output, decoded into typed objects.
type rendered struct {
	dir              string
	serviceAccounts  []corev1.ServiceAccount
	services         []corev1.Service
	deployments      []appsv1.Deployment
	roles            []rbacv1.Role
	roleBindings     []rbacv1.RoleBinding
	pools            []inferencev1.InferencePool
	gateways         []gatewayv1.Gateway
	httpRoutes       []gatewayv1.HTTPRoute
	destinationRules []destinationRule
	networkPolicies  []networkingv1.NetworkPolicy
}

// strict decodes JSON into out, rejecting unknown fields.
func strict(js []byte, out any) error {
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	return dec.Decode(out)
}

// decodeInto appends the strict decoding of js to *list.
func decodeInto[T any](js []byte, list *[]T) error {
	var v T
	if err := strict(js, &v); err != nil {
		return err
	}
	*list = append(*list, v)
	return nil
}

// render builds dir with the kustomize API (the engine behind `kubectl kustomize`) and decodes
// every object strictly into its typed struct; an object of a kind the manifests should not
// contain fails the test.
func render(t *testing.T, dir string) *rendered {
	t.Helper()
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize %s: %v", dir, err)
	}
	out := &rendered{dir: dir}
	for _, res := range m.Resources() {
		y, err := res.AsYAML()
		if err != nil {
			t.Fatal(err)
		}
		js, err := yaml.YAMLToJSON(y)
		if err != nil {
			t.Fatal(err)
		}
		var err2 error
		switch gvk := res.GetApiVersion() + "/" + res.GetKind(); gvk {
		case "v1/ServiceAccount":
			err2 = decodeInto(js, &out.serviceAccounts)
		case "v1/Service":
			err2 = decodeInto(js, &out.services)
		case "apps/v1/Deployment":
			err2 = decodeInto(js, &out.deployments)
		case "rbac.authorization.k8s.io/v1/Role":
			err2 = decodeInto(js, &out.roles)
		case "rbac.authorization.k8s.io/v1/RoleBinding":
			err2 = decodeInto(js, &out.roleBindings)
		case "inference.networking.k8s.io/v1/InferencePool":
			err2 = decodeInto(js, &out.pools)
		case "gateway.networking.k8s.io/v1/Gateway":
			err2 = decodeInto(js, &out.gateways)
		case "gateway.networking.k8s.io/v1/HTTPRoute":
			err2 = decodeInto(js, &out.httpRoutes)
		case "networking.k8s.io/v1/NetworkPolicy":
			err2 = decodeInto(js, &out.networkPolicies)
		case "networking.istio.io/v1/DestinationRule":
			err2 = decodeInto(js, &out.destinationRules)
		default:
			t.Fatalf("%s renders an unexpected %s %s", dir, gvk, res.GetName())
		}
		if err2 != nil {
			t.Fatalf("%s: %s %s does not decode strictly: %v", dir, res.GetKind(), res.GetName(), err2)
		}
	}
	return out
}

// kustomizations lists every directory of manifests/ holding a kustomization.yaml.
func kustomizations(t *testing.T) []string {
	t.Helper()
	var dirs []string
	err := filepath.WalkDir(".", func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && d.Name() == "kustomization.yaml" {
			dirs = append(dirs, filepath.Dir(p))
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"base", "examples/vllm", "overlays/envoy-gateway", "overlays/istio", "overlays/istio-plaintext", "overlays/kgateway"}
	if !slices.Equal(dirs, want) {
		t.Fatalf("kustomizations %v, want %v", dirs, want)
	}
	return dirs
}

func TestEveryKustomizationRenders(t *testing.T) {
	kubectl, _ := exec.LookPath("kubectl")
	for _, dir := range kustomizations(t) {
		t.Run(dir, func(t *testing.T) {
			r := render(t, dir)
			if kubectl == "" {
				return
			}
			// The command the README gives operators renders the same objects.
			out, err := exec.Command(kubectl, "kustomize", dir).CombinedOutput()
			if err != nil {
				t.Fatalf("kubectl kustomize %s: %v\n%s", dir, err, out)
			}
			if got, want := strings.Count(string(out), "\nkind: ")+boolInt(strings.HasPrefix(string(out), "kind: ")), r.count(); got != want {
				t.Errorf("kubectl kustomize %s: %d objects, the kustomize API %d", dir, got, want)
			}
		})
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (r *rendered) count() int {
	return len(r.serviceAccounts) + len(r.services) + len(r.deployments) + len(r.roles) + len(r.roleBindings) +
		len(r.pools) + len(r.gateways) + len(r.httpRoutes) + len(r.destinationRules) + len(r.networkPolicies)
}

// epp returns the base's EPP Deployment, Service and pool.
func epp(t *testing.T, r *rendered) (*appsv1.Deployment, *corev1.Service, *inferencev1.InferencePool) {
	t.Helper()
	if len(r.deployments) != 1 || len(r.pools) != 1 {
		t.Fatalf("%s: %d deployments, %d pools; want one each", r.dir, len(r.deployments), len(r.pools))
	}
	svc := service(t, r, eppServiceName)
	return &r.deployments[0], svc, &r.pools[0]
}

// eppServiceName and peerServiceName are the base's EPP Service (what the InferencePool's
// endpointPickerRef names) and its headless peer Service (DYN_EPP_PEER_SERVICE).
const (
	eppServiceName  = "kvepp"
	peerServiceName = "kvepp-peers"
)

// service returns the rendered Service called name.
func service(t *testing.T, r *rendered, name string) *corev1.Service {
	t.Helper()
	for i := range r.services {
		if r.services[i].Name == name {
			return &r.services[i]
		}
	}
	t.Fatalf("%s: no Service %q", r.dir, name)
	return nil
}

func container(t *testing.T, d *appsv1.Deployment, name string) *corev1.Container {
	t.Helper()
	for i := range d.Spec.Template.Spec.Containers {
		if d.Spec.Template.Spec.Containers[i].Name == name {
			return &d.Spec.Template.Spec.Containers[i]
		}
	}
	t.Fatalf("deployment %s has no container %q", d.Name, name)
	return nil
}

func env(c *corev1.Container) map[string]corev1.EnvVar {
	out := map[string]corev1.EnvVar{}
	for _, e := range c.Env {
		out[e.Name] = e
	}
	return out
}

func TestBaseRBACIsExactlyWhatDiscoveryUses(t *testing.T) {
	r := render(t, "base")
	if len(r.roles) != 1 || len(r.roleBindings) != 1 || len(r.serviceAccounts) != 1 {
		t.Fatalf("%d roles, %d bindings, %d service accounts", len(r.roles), len(r.roleBindings), len(r.serviceAccounts))
	}
	sort := cmpopts.SortSlices(func(a, b rbacv1.PolicyRule) bool { return a.Resources[0] < b.Resources[0] })
	if diff := cmp.Diff(discovery.RBACRules(), r.roles[0].Rules, sort); diff != "" {
		t.Errorf("Role rules differ from discovery.RBACRules() (-discovery +manifest):\n%s", diff)
	}
	b, sa := r.roleBindings[0], r.serviceAccounts[0]
	d, _, _ := epp(t, r)
	if b.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: r.roles[0].Name}) ||
		len(b.Subjects) != 1 || b.Subjects[0] != (rbacv1.Subject{Kind: "ServiceAccount", Name: sa.Name, Namespace: sa.Namespace}) ||
		d.Spec.Template.Spec.ServiceAccountName != sa.Name {
		t.Errorf("binding %+v does not bind the Role to the EPP's ServiceAccount %s/%s (pod uses %q)", b, sa.Namespace, sa.Name, d.Spec.Template.Spec.ServiceAccountName)
	}
}

func TestBaseDeployment(t *testing.T) {
	r := render(t, "base")
	d, svc, pool := epp(t, r)
	c := container(t, d, "epp")

	t.Run("probes are gRPC health checks on the health port with the service names kvepp answers", func(t *testing.T) {
		for name, p := range map[string]*corev1.Probe{extproc.HealthLiveness: c.LivenessProbe, extproc.HealthReadiness: c.ReadinessProbe} {
			if p == nil || p.GRPC == nil || p.GRPC.Port != 9003 || p.GRPC.Service == nil || *p.GRPC.Service != name {
				t.Errorf("%s probe %+v, want grpc port 9003 service %q", name, p, name)
			}
		}
	})
	t.Run("ports: ext_proc 9002 (http2), health 9003, metrics 9090, selection 8092, replica sync 9092", func(t *testing.T) {
		got := map[string]int32{}
		for _, p := range c.Ports {
			got[p.Name] = p.ContainerPort
		}
		if want := map[string]int32{"grpc-ext-proc": 9002, "grpc-health": 9003, "http-metrics": 9090, "selection-http": 8092, "replica-agg": 9092}; !cmp.Equal(got, want) {
			t.Errorf("container ports %v, want %v", got, want)
		}
		sp := map[string]corev1.ServicePort{}
		for _, p := range svc.Spec.Ports {
			sp[p.Name] = p
		}
		for name, port := range map[string]int32{"grpc-ext-proc": 9002, "grpc-health": 9003, "http-metrics": 9090, "selection-http": 8092} {
			if p, ok := sp[name]; !ok || p.Port != port || p.TargetPort.StrVal != name {
				t.Errorf("service port %s = %+v", name, p)
			}
		}
		if ap := sp["grpc-ext-proc"].AppProtocol; ap == nil || *ap != "http2" {
			t.Errorf("ext_proc service port appProtocol %v, want http2", ap)
		}
		if !cmp.Equal(svc.Spec.Selector, d.Spec.Template.Labels) {
			t.Errorf("service selector %v does not select the pod labels %v", svc.Spec.Selector, d.Spec.Template.Labels)
		}
	})
	t.Run("several replicas find each other through the headless peer Service's named ports", func(t *testing.T) {
		if d.Spec.Replicas == nil || *d.Spec.Replicas < 2 {
			t.Errorf("replicas %v, want at least 2", d.Spec.Replicas)
		}
		peers := service(t, r, peerServiceName)
		if peers.Spec.ClusterIP != corev1.ClusterIPNone || !cmp.Equal(peers.Spec.Selector, d.Spec.Template.Labels) {
			t.Errorf("peer Service clusterIP %q selector %v: want headless, selecting the EPP pods %v", peers.Spec.ClusterIP, peers.Spec.Selector, d.Spec.Template.Labels)
		}
		ports := map[string]int32{}
		for _, p := range peers.Spec.Ports {
			ports[p.Name] = p.Port
		}
		if want := map[string]int32{discovery.PeerPortReplica: 9092, discovery.PeerPortSelection: 8092}; !cmp.Equal(ports, want) {
			t.Errorf("peer Service ports %v, want %v (the names peer discovery reads)", ports, want)
		}
		e := env(c)
		if e["DYN_EPP_PEER_SERVICE"].Value != peers.Name || e["DYN_EPP_REPLICA_SYNC_PORT"].Value != "9092" {
			t.Errorf("DYN_EPP_PEER_SERVICE %q, DYN_EPP_REPLICA_SYNC_PORT %q", e["DYN_EPP_PEER_SERVICE"].Value, e["DYN_EPP_REPLICA_SYNC_PORT"].Value)
		}
		if ip := e["POD_IP"]; ip.ValueFrom == nil || ip.ValueFrom.FieldRef == nil || ip.ValueFrom.FieldRef.FieldPath != "status.podIP" {
			t.Errorf("POD_IP %+v, want the downward API's status.podIP (a replica is never its own peer)", ip)
		}
	})
	t.Run("the NetworkPolicy keeps the selection API and the sync port to the EPP replicas", func(t *testing.T) {
		if len(r.networkPolicies) != 1 {
			t.Fatalf("%d NetworkPolicies, want 1", len(r.networkPolicies))
		}
		np := r.networkPolicies[0]
		if !cmp.Equal(np.Spec.PodSelector.MatchLabels, d.Spec.Template.Labels) {
			t.Errorf("policy selects %v, want the EPP pods %v", np.Spec.PodSelector.MatchLabels, d.Spec.Template.Labels)
		}
		open, replicasOnly := map[string]bool{}, map[string]bool{}
		for _, rule := range np.Spec.Ingress {
			for _, p := range rule.Ports {
				if p.Port == nil {
					t.Fatalf("rule %+v opens every port", rule)
				}
				switch {
				case len(rule.From) == 0:
					open[p.Port.StrVal] = true
				case len(rule.From) == 1 && rule.From[0].PodSelector != nil && rule.From[0].NamespaceSelector == nil &&
					cmp.Equal(rule.From[0].PodSelector.MatchLabels, d.Spec.Template.Labels):
					replicasOnly[p.Port.StrVal] = true
				default:
					t.Errorf("unexpected rule %+v", rule)
				}
			}
		}
		if want := map[string]bool{"grpc-ext-proc": true, "grpc-health": true, "http-metrics": true}; !cmp.Equal(open, want) {
			t.Errorf("ports open to all %v, want %v", open, want)
		}
		if want := map[string]bool{"selection-http": true, "replica-agg": true}; !cmp.Equal(replicasOnly, want) {
			t.Errorf("ports open to the replicas only %v, want %v", replicasOnly, want)
		}
		names := map[string]bool{}
		for _, p := range c.Ports {
			names[p.Name] = true
		}
		for p := range open {
			if !names[p] {
				t.Errorf("policy names port %q the container does not have", p)
			}
		}
	})
	t.Run("every container runs non-root with a read-only root filesystem and no capabilities", func(t *testing.T) {
		ps := d.Spec.Template.Spec.SecurityContext
		if ps == nil || ps.RunAsNonRoot == nil || !*ps.RunAsNonRoot || ps.RunAsUser == nil || *ps.RunAsUser == 0 {
			t.Errorf("pod security context %+v", ps)
		}
		all := append(slices.Clone(d.Spec.Template.Spec.InitContainers), d.Spec.Template.Spec.Containers...)
		for _, c := range all {
			sc := c.SecurityContext
			if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.AllowPrivilegeEscalation == nil ||
				*sc.AllowPrivilegeEscalation || sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
				t.Errorf("container %s security context %+v", c.Name, sc)
			}
			if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
				t.Errorf("container %s resources %+v", c.Name, c.Resources)
			}
		}
	})
	t.Run("the InferencePool's endpointPickerRef is the EPP Service's ext_proc port", func(t *testing.T) {
		ref := pool.Spec.EndpointPickerRef
		if ref == nil || string(ref.Name) != svc.Name || ref.Port == nil || ref.Port.Number != 9002 || (ref.Kind != "" && ref.Kind != "Service") {
			t.Errorf("endpointPickerRef %+v", ref)
		}
		if e := env(c)["DYN_EPP_INFERENCE_POOL_NAME"]; e.Value != pool.Name {
			t.Errorf("DYN_EPP_INFERENCE_POOL_NAME %q, pool %q", e.Value, pool.Name)
		}
		if e := env(c)["POD_NAMESPACE"]; e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != "metadata.namespace" {
			t.Errorf("POD_NAMESPACE %+v, want the downward API's metadata.namespace", e)
		}
	})
	t.Run("the environment is a valid kvepp configuration of known settings", func(t *testing.T) {
		environ := []string{}
		for _, e := range c.Env {
			v := e.Value
			if e.ValueFrom != nil {
				v = strings.ToLower("from-" + strings.ReplaceAll(e.Name, "_", "-")) // downward API values (a valid namespace name)
			}
			if e.Name == "DYN_EPP_TOKENIZER_DIR" {
				v = sharedtest.Qwen3TokenizerDir(t) // what the init container downloads
			}
			if _, known := runner.CanonicalSettingName(e.Name); !known && e.Name != "POD_NAMESPACE" && e.Name != "POD_IP" {
				t.Errorf("env %s is not a kvepp setting", e.Name)
			}
			if e.Name == "DYN_EPP_CONFORMANCE_TEST_HOOKS" {
				t.Errorf("the conformance hooks must stay off in the base manifests")
			}
			environ = append(environ, e.Name+"="+v)
		}
		if _, err := runner.LoadConfig(environ, c.Args, nil); err != nil {
			t.Errorf("the Deployment's configuration does not load: %v", err)
		}
	})
	t.Run("the image is the one the Dockerfile builds, running as its user", func(t *testing.T) {
		df, err := os.ReadFile("../Dockerfile")
		if err != nil {
			t.Fatal(err)
		}
		name, _, _ := strings.Cut(c.Image, ":")
		if !strings.Contains(string(df), "docker build -t "+name+" .") {
			t.Errorf("image %q is not the Dockerfile's `docker build -t` tag", c.Image)
		}
		uid := *d.Spec.Template.Spec.SecurityContext.RunAsUser
		if !strings.Contains(string(df), fmt.Sprintf("USER %d:%d", uid, uid)) {
			t.Errorf("runAsUser %d is not the Dockerfile's USER", uid)
		}
		for _, p := range c.Ports {
			if !strings.Contains(string(df), strconv.Itoa(int(p.ContainerPort))) {
				t.Errorf("port %d is not exposed by the Dockerfile", p.ContainerPort)
			}
		}
	})
	t.Run("the tokenizer files reach the EPP's tokenizer directory", func(t *testing.T) {
		if len(d.Spec.Template.Spec.InitContainers) != 1 {
			t.Fatalf("init containers %d", len(d.Spec.Template.Spec.InitContainers))
		}
		ic := d.Spec.Template.Spec.InitContainers[0]
		script := strings.Join(ic.Command, " ")
		for _, f := range []string{"tokenizer.json", "tokenizer_config.json"} {
			if !strings.Contains(script, f) {
				t.Errorf("init container does not fetch %s", f)
			}
		}
		mount := func(c corev1.Container) string {
			for _, m := range c.VolumeMounts {
				if m.Name == "tokenizer" {
					return m.MountPath
				}
			}
			return ""
		}
		if mount(ic) == "" || mount(ic) != mount(*c) || env(c)["DYN_EPP_TOKENIZER_DIR"].Value != mount(*c) {
			t.Errorf("tokenizer volume: init %q, epp %q, DYN_EPP_TOKENIZER_DIR %q", mount(ic), mount(*c), env(c)["DYN_EPP_TOKENIZER_DIR"].Value)
		}
		if e := env(&ic)["TOKENIZER_MODEL"]; e.Value != env(c)["DYN_MODEL_NAME"].Value {
			t.Errorf("the init container fetches %q's tokenizer, the EPP serves %q", e.Value, env(c)["DYN_MODEL_NAME"].Value)
		}
	})
	t.Run("the init container's script fetches the optional files a model has and fails on errors", func(t *testing.T) {
		runFetchScript(t, d.Spec.Template.Spec.InitContainers[0])
	})
}

// runFetchScript runs the init container's shell script with curl against a fake Hugging Face
// Hub: the required files and the optional ones the model has (config.json here) are fetched,
// an optional file the model lacks (a 404: chat_template.jinja) is skipped, and any other error
// — a required file missing, an optional one answering 500 — fails the container.
func runFetchScript(t *testing.T, ic corev1.Container) {
	if _, err := exec.LookPath("curl"); err != nil {
		t.Skip("curl is not installed")
	}
	if len(ic.Command) != 3 || ic.Command[0] != "sh" {
		t.Fatalf("init container command %q, want sh -ec <script>", ic.Command)
	}
	for _, tc := range []struct {
		name   string
		answer map[string]int // file → status (absent: 404)
		ok     bool
		files  []string
	}{
		{"a model without chat_template.jinja", map[string]int{"tokenizer.json": 200, "tokenizer_config.json": 200, "config.json": 200}, true,
			[]string{"config.json", "tokenizer.json", "tokenizer_config.json"}},
		{"a model with every file", map[string]int{"tokenizer.json": 200, "tokenizer_config.json": 200, "config.json": 200, "chat_template.jinja": 200}, true,
			[]string{"chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json"}},
		{"a missing tokenizer.json", map[string]int{"tokenizer_config.json": 200}, false, nil},
		{"an optional file refused", map[string]int{"tokenizer.json": 200, "tokenizer_config.json": 200, "config.json": 403}, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hub := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				name := filepath.Base(r.URL.Path)
				if !strings.HasPrefix(r.URL.Path, "/org/model/resolve/main/") {
					http.NotFound(w, r)
					return
				}
				st, ok := tc.answer[name]
				if !ok {
					st = http.StatusNotFound
				}
				w.WriteHeader(st)
				fmt.Fprintf(w, "%s %d", name, st)
			}))
			defer hub.Close()
			dir := t.TempDir()
			script := strings.ReplaceAll(ic.Command[2], "/tokenizer", dir)
			cmd := exec.Command("sh", "-ec", script)
			cmd.Env = append(os.Environ(), "HF_ENDPOINT="+hub.URL, "TOKENIZER_MODEL=org/model", "TOKENIZER_REVISION=main", "HF_TOKEN=")
			out, err := cmd.CombinedOutput()
			if (err == nil) != tc.ok {
				t.Fatalf("script error %v, want ok=%t; output:\n%s", err, tc.ok, out)
			}
			if !tc.ok {
				return
			}
			entries, _ := os.ReadDir(dir)
			var got []string
			for _, e := range entries {
				got = append(got, e.Name())
				if b, _ := os.ReadFile(filepath.Join(dir, e.Name())); string(b) != e.Name()+" 200" {
					t.Errorf("%s holds %q", e.Name(), b)
				}
			}
			if !slices.Equal(got, tc.files) {
				t.Fatalf("fetched %v, want %v; output:\n%s", got, tc.files, out)
			}
		})
	}
}

// vllmArg returns the value of --name=value in args ("" when absent; present reports bare flags).
func vllmArg(args []string, name string) (value string, present bool) {
	for _, a := range args {
		if a == name {
			return "", true
		}
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v, true
		}
	}
	return "", false
}

func TestVLLMExampleMatchesThePoolAndTheEPP(t *testing.T) {
	base := render(t, "base")
	d, _, pool := epp(t, base)
	eppEnv := env(container(t, d, "epp"))
	ex := render(t, "examples/vllm")
	if len(ex.deployments) != 1 {
		t.Fatalf("%d deployments", len(ex.deployments))
	}
	v := ex.deployments[0]
	c := container(t, &v, "vllm")
	for k, want := range pool.Spec.Selector.MatchLabels {
		if v.Spec.Template.Labels[string(k)] != string(want) {
			t.Errorf("vLLM pods lack the pool label %s=%s: %v", k, want, v.Spec.Template.Labels)
		}
	}
	if v.Namespace != pool.Namespace {
		t.Errorf("vLLM namespace %q, pool %q", v.Namespace, pool.Namespace)
	}
	if _, on := vllmArg(c.Args, "--enable-prefix-caching"); !on {
		t.Error("prefix caching is off")
	}
	for flag, want := range map[string]string{
		"--block-size":        eppEnv["DYN_KV_CACHE_BLOCK_SIZE"].Value,
		"--served-model-name": eppEnv["DYN_MODEL_NAME"].Value,
		"--port":              strconv.Itoa(int(pool.Spec.TargetPorts[0].Number)),
	} {
		if got, _ := vllmArg(c.Args, flag); got != want {
			t.Errorf("vLLM %s=%q, kvepp/pool want %q", flag, got, want)
		}
	}
	raw, _ := vllmArg(c.Args, "--kv-events-config")
	var kv struct {
		Enable   bool   `json:"enable_kv_cache_events"`
		Pub      string `json:"publisher"`
		Endpoint string `json:"endpoint"`
		Replay   string `json:"replay_endpoint"`
		Topic    string `json:"topic"`
	}
	if err := strict([]byte(raw), &kv); err != nil {
		t.Fatalf("--kv-events-config %q: %v", raw, err)
	}
	if !kv.Enable || kv.Pub != "zmq" || kv.Endpoint != "tcp://*:"+eppEnv["DYN_EPP_KV_EVENT_PORT"].Value ||
		kv.Replay != "tcp://*:"+eppEnv["DYN_EPP_KV_EVENT_REPLAY_PORT"].Value {
		t.Errorf("--kv-events-config %+v does not publish where kvepp subscribes (port %s, replay %s)", kv,
			eppEnv["DYN_EPP_KV_EVENT_PORT"].Value, eppEnv["DYN_EPP_KV_EVENT_REPLAY_PORT"].Value)
	}
	if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil || c.ReadinessProbe.HTTPGet.Path != "/health" {
		t.Errorf("vLLM readiness probe %+v", c.ReadinessProbe)
	}
}

func TestOverlaysRouteTheGatewayToThePool(t *testing.T) {
	for dir, class := range map[string]string{
		"overlays/envoy-gateway": "eg", "overlays/istio": "istio", "overlays/istio-plaintext": "istio", "overlays/kgateway": "kgateway",
	} {
		t.Run(dir, func(t *testing.T) {
			r := render(t, dir)
			d, svc, pool := epp(t, r)
			if len(r.gateways) != 1 || len(r.httpRoutes) != 1 {
				t.Fatalf("%d gateways, %d routes", len(r.gateways), len(r.httpRoutes))
			}
			gw, route := r.gateways[0], r.httpRoutes[0]
			if string(gw.Spec.GatewayClassName) != class {
				t.Errorf("gatewayClassName %q, want %q", gw.Spec.GatewayClassName, class)
			}
			if len(route.Spec.ParentRefs) != 1 || string(route.Spec.ParentRefs[0].Name) != gw.Name {
				t.Errorf("route parents %+v", route.Spec.ParentRefs)
			}
			if len(route.Spec.Rules) != 1 || len(route.Spec.Rules[0].BackendRefs) != 1 {
				t.Fatalf("route rules %+v", route.Spec.Rules)
			}
			br := route.Spec.Rules[0].BackendRefs[0]
			if br.Group == nil || string(*br.Group) != inferencev1.GroupName || br.Kind == nil || *br.Kind != "InferencePool" ||
				string(br.Name) != pool.Name || (br.Namespace != nil && string(*br.Namespace) != pool.Namespace) {
				t.Errorf("backendRef %+v is not the pool %s", br, pool.Name)
			}
			secure := env(container(t, d, "epp"))["DYN_EPP_SECURE_SERVING"].Value
			if class != "istio" {
				if secure != "true" {
					t.Errorf("%s speaks TLS to the EPP; DYN_EPP_SECURE_SERVING=%q", class, secure)
				}
				return
			}
			if len(r.destinationRules) != 1 {
				t.Fatalf("%d DestinationRules", len(r.destinationRules))
			}
			dr := r.destinationRules[0]
			mode := map[string]string{"true": "SIMPLE", "false": "DISABLE"}[secure]
			if dr.Spec.Host != svc.Name || dr.Spec.TrafficPolicy.TLS.Mode != mode || dr.Spec.TrafficPolicy.TLS.InsecureSkipVerify != (mode == "SIMPLE") {
				t.Errorf("DestinationRule %+v for an EPP with DYN_EPP_SECURE_SERVING=%s", dr.Spec, secure)
			}
		})
	}
}

// TestDockerRunCommandsMountDirectoriesThatExist: every `docker run -v $PWD/<dir>:…` in the
// Dockerfile's header and the README, run from the repository root as they say, mounts a
// directory that exists there.
func TestDockerRunCommandsMountDirectoriesThatExist(t *testing.T) {
	mount := regexp.MustCompile(`-v "?\$PWD/([^:"]+):`)
	for _, f := range []string{"../Dockerfile", "../README.md"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		found := mount.FindAllSubmatch(b, -1)
		if len(found) == 0 {
			t.Fatalf("%s has no docker run -v $PWD/… mount", f)
		}
		for _, m := range found {
			if st, err := os.Stat(filepath.Join("..", string(m[1]))); err != nil || !st.IsDir() {
				t.Errorf("%s mounts $PWD/%s, which is not a directory from the repository root: %v", f, m[1], err)
			}
		}
	}
}

// TestTheREADMEImageOverlayRenders: install step 3 of manifests/README.md points the manifests at
// the operator's image with an overlay kustomization (its `images:` field — what `kubectl apply
// -k` understands, no standalone kustomize binary needed). The overlay as the README writes it,
// with its placeholders filled in, renders and sets the EPP's image.
func TestTheREADMEImageOverlayRenders(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(readme, []byte("kustomize edit")) {
		t.Error("README.md uses `kustomize edit`, which kubectl does not provide")
	}
	block := regexp.MustCompile("(?s)\n( *)```yaml\n *# (manifests/overlays/[a-z0-9-]+)/kustomization\\.yaml\n(.*?)```").FindSubmatch(readme)
	if block == nil {
		t.Fatal("README.md has no ```yaml block starting with `# manifests/overlays/<name>/kustomization.yaml`")
	}
	indent := "\n" + string(block[1]) // the block sits in a list item
	block = [][]byte{nil, block[2], []byte(strings.ReplaceAll("\n"+string(block[3]), indent, "\n"))}
	fs := filesys.MakeFsInMemory()
	err = filepath.WalkDir(".", func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".yaml") {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return fs.WriteFile(filepath.Join("/manifests", p), b)
	})
	if err != nil {
		t.Fatal(err)
	}
	overlay := strings.NewReplacer("<registry>", "registry.example.com", "<tag>", "v1.2.3").Replace(string(block[2]))
	dir := "/" + string(block[1])
	if err := fs.WriteFile(dir+"/kustomization.yaml", []byte(overlay)); err != nil {
		t.Fatal(err)
	}
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(fs, dir)
	if err != nil {
		t.Fatalf("kustomize the README's overlay:\n%s\n%v", overlay, err)
	}
	images := 0
	for _, res := range m.Resources() {
		if res.GetKind() != "Deployment" || res.GetName() != "kvepp" {
			continue
		}
		js, _ := res.MarshalJSON()
		var d appsv1.Deployment
		if err := json.Unmarshal(js, &d); err != nil {
			t.Fatal(err)
		}
		for _, c := range d.Spec.Template.Spec.Containers {
			if c.Name == "epp" && c.Image == "registry.example.com/kvepp/epp:v1.2.3" {
				images++
			}
		}
	}
	if images != 1 {
		t.Fatalf("the README's overlay does not set the epp image to registry.example.com/kvepp/epp:v1.2.3:\n%s", overlay)
	}
}
