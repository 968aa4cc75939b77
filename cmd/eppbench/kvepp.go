package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/runner"
)

// childEnv marks the process as a kvepp instance started by eppbench (see runChild).
const childEnv = "EPPBENCH_KVEPP_CHILD"

// childProfileEnv, when set in a child's environment, names the file the child writes its CPU
// profile to (--kvepp-cpuprofile).
const childProfileEnv = "EPPBENCH_KVEPP_CPUPROFILE"

// childAddrs is the line a child prints on stdout once it is ready.
type childAddrs struct {
	GRPC      string `json:"grpc"`
	Selection string `json:"selection"`
	Metrics   string `json:"metrics"`
}

// runChild is the kvepp process: the real composition root (runner.Start) configured from the
// environment exactly like cmd/epp, with the benchmark's registry. It prints its bound addresses
// as one JSON line on stdout and stops gracefully on SIGTERM/SIGINT or when stdin closes (the
// parent died).
func runChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if path := os.Getenv(childProfileEnv); path != "" {
		f, err := os.Create(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, "eppbench kvepp:", err)
			return 1
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, "eppbench kvepp:", err)
			return 1
		}
		defer func() { pprof.StopCPUProfile(); _ = f.Close() }()
	}
	reg := catalog.Builtins()
	cfg, err := runner.LoadConfig(os.Environ(), nil, os.Stderr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "eppbench kvepp:", err)
		return 1
	}
	inst, err := runner.Start(ctx, runner.Options{Config: cfg, Registry: reg})
	if err != nil {
		fmt.Fprintln(os.Stderr, "eppbench kvepp:", err)
		return 1
	}
	a := inst.Addrs()
	line, _ := json.Marshal(childAddrs{GRPC: a.GRPC, Selection: a.Selection, Metrics: a.Metrics})
	fmt.Fprintf(os.Stdout, "%s\n", line)
	stdinClosed := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stdinClosed)
	}()
	select {
	case <-ctx.Done():
	case <-stdinClosed:
	case <-inst.Failed():
	}
	stopErr := inst.Stop(context.Background())
	if err := errors.Join(inst.Err(), stopErr); err != nil {
		fmt.Fprintln(os.Stderr, "eppbench kvepp:", err)
		return 1
	}
	return 0
}

// kveppSpec is how one kvepp instance is configured.
type kveppSpec struct {
	// Instance is the worker_selection instance to select ("default" = built-in).
	Instance string
	// PolicyConfig is the generated policy YAML path.
	PolicyConfig string
	// UseKVEvents selects event-driven (true) or approximate (false) indexing.
	UseKVEvents bool
	// WorkersFile is the workers file path.
	WorkersFile string
	// Model is DYN_MODEL_NAME.
	Model string
	// BlockSize is DYN_KV_CACHE_BLOCK_SIZE, tokens.
	BlockSize int
	// TokenizerDir is DYN_EPP_TOKENIZER_DIR.
	TokenizerDir string
	// ApproxTTL is DYN_ROUTER_TTL_SECS (wall-clock).
	ApproxTTL time.Duration
	// LogLevel is DYN_LOG.
	LogLevel string
	// LogFile receives the child's stderr.
	LogFile string
	// Extra are KEY=VALUE settings added last (so they win), e.g. router knobs.
	Extra []string
	// CPUProfile, when set, is the file the child writes its CPU profile to.
	CPUProfile string
}

// benchOwnedSettings are the kvepp settings environ sets itself, each with what to use instead.
// resolveSetting refuses them, so neither a router's settings nor --kvepp-env can quietly undo the
// wiring to the simulated pool (TestBenchOwnedSettingsMatchEnviron keeps the two lists equal).
var benchOwnedSettings = func() map[string]string {
	const wiring = "it wires kvepp to the simulated pool and the proxy"
	return map[string]string{
		"DYN_EPP_BIND_ADDRESS":               wiring,
		"DYN_EPP_GRPC_PORT":                  wiring,
		"DYN_EPP_GRPC_HEALTH_PORT":           wiring,
		"DYN_EPP_SELECTION_HTTP_PORT":        wiring,
		"DYN_EPP_METRICS_PORT":               wiring,
		"DYN_EPP_SECURE_SERVING":             wiring + " (plaintext ext_proc)",
		"DYN_EPP_DRAIN_TIMEOUT_SECS":         wiring,
		"DYN_EPP_WORKERS_FILE":               wiring,
		"DYN_MODEL_NAME":                     wiring,
		"DYN_KV_CACHE_BLOCK_SIZE":            "use --block-size, which the simulated workers share",
		"DYN_EPP_TOKENIZER_PROTOCOL":         "use --tokenizer-dir",
		"DYN_EPP_TOKENIZER_DIR":              "use --tokenizer-dir",
		"DYN_ROUTER_USE_KV_EVENTS":           "use the kvepp-approx router for approximate mode",
		"DYN_ROUTER_POLICY_CONFIG":           "use --policies or --policy-config",
		"DYN_ROUTER_WORKER_SELECTION_POLICY": "use --policies or --policy-config",
		"DYN_ROUTER_TTL_SECS":                "the approximate index keeps 120 s of simulated time, scaled by --speedup",
		"DYN_LOG":                            "use --log-level",
	}
}()

// environ builds the child's environment: the parent's environment without any DYN_* variable
// (so a stray setting cannot skew a baseline), plus the benchmark's settings.
func (s kveppSpec) environ() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DYN_") && !strings.HasPrefix(kv, childEnv+"=") && !strings.HasPrefix(kv, childProfileEnv+"=") {
			env = append(env, kv)
		}
	}
	if s.CPUProfile != "" {
		env = append(env, childProfileEnv+"="+s.CPUProfile)
	}
	return append(append(env,
		childEnv+"=1",
		"DYN_EPP_BIND_ADDRESS=127.0.0.1",
		"DYN_EPP_GRPC_PORT=0",
		"DYN_EPP_GRPC_HEALTH_PORT=0",
		"DYN_EPP_SELECTION_HTTP_PORT=0",
		"DYN_EPP_METRICS_PORT=0",
		"DYN_EPP_SECURE_SERVING=false",
		"DYN_EPP_DRAIN_TIMEOUT_SECS=0",
		"DYN_EPP_WORKERS_FILE="+s.WorkersFile,
		"DYN_MODEL_NAME="+s.Model,
		"DYN_KV_CACHE_BLOCK_SIZE="+strconv.Itoa(s.BlockSize),
		"DYN_EPP_TOKENIZER_PROTOCOL=local",
		"DYN_EPP_TOKENIZER_DIR="+s.TokenizerDir,
		"DYN_ROUTER_USE_KV_EVENTS="+strconv.FormatBool(s.UseKVEvents),
		"DYN_ROUTER_POLICY_CONFIG="+s.PolicyConfig,
		"DYN_ROUTER_WORKER_SELECTION_POLICY="+s.Instance,
		"DYN_ROUTER_TTL_SECS="+strconv.FormatFloat(max(s.ApproxTTL.Seconds(), 0.001), 'f', -1, 64),
		"DYN_LOG="+s.LogLevel,
	), s.Extra...)
}

// logWarnings returns "; kvepp log: …" with the last three warning or error lines of the kvepp
// log (which say, e.g., why a worker is not schedulable), or "" when there are none.
func (p *kveppProcess) logWarnings() string {
	data, err := os.ReadFile(p.log.Name())
	if err != nil {
		return ""
	}
	var lines []string
	for _, l := range strings.Split(string(data), "\n") {
		if strings.Contains(l, `"level":"warn"`) || strings.Contains(l, `"level":"error"`) {
			lines = append(lines, strings.TrimSpace(l))
		}
	}
	if len(lines) == 0 {
		return ""
	}
	return "; kvepp log: " + strings.Join(lines[max(0, len(lines)-3):], " | ")
}

// kveppProcess is a running kvepp child.
type kveppProcess struct {
	cmd   *exec.Cmd
	addrs childAddrs
	stdin io.WriteCloser
	log   *os.File
	done  chan struct{} // closed when the process exited
	err   error         // Wait's result, valid after done
}

// startKvepp starts this executable as a kvepp child with spec and waits (up to timeout) for its
// address line.
func startKvepp(spec kveppSpec, timeout time.Duration) (*kveppProcess, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find own executable: %w", err)
	}
	logf, err := os.Create(spec.LogFile)
	if err != nil {
		return nil, fmt.Errorf("create kvepp log: %w", err)
	}
	cmd := exec.Command(exe)
	cmd.Env = spec.environ()
	cmd.Stderr = logf
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		logf.Close()
		return nil, err
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		logf.Close()
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start kvepp: %w", err)
	}
	p := &kveppProcess{cmd: cmd, stdin: stdin, log: logf, done: make(chan struct{})}
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		if sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		_, _ = io.Copy(io.Discard, stdout)
	}()
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	fail := func(err error) (*kveppProcess, error) {
		_ = p.stop()
		return nil, fmt.Errorf("%w (log: %s)", err, spec.LogFile)
	}
	select {
	case line, ok := <-lines:
		if !ok {
			<-p.done
			return fail(fmt.Errorf("kvepp exited before it was ready: %v: %s", p.err, tail(spec.LogFile)))
		}
		if err := json.Unmarshal([]byte(line), &p.addrs); err != nil || p.addrs.GRPC == "" {
			return fail(fmt.Errorf("kvepp printed %q instead of its addresses", line))
		}
	case <-time.After(timeout):
		return fail(fmt.Errorf("kvepp not ready after %v", timeout))
	}
	return p, nil
}

// exited reports whether the child has exited.
func (p *kveppProcess) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// cpuTime returns the child's user+system CPU time so far from /proc/<pid>/stat (Linux), or
// false when that is unavailable.
func (p *kveppProcess) cpuTime() (time.Duration, bool) {
	return procCPU(p.cmd.Process.Pid)
}

// peakRSS returns the child's peak resident set size in bytes from /proc/<pid>/status (VmHWM),
// or 0 when unavailable.
func (p *kveppProcess) peakRSS() int64 {
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(p.cmd.Process.Pid), "status"))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			f := strings.Fields(rest)
			if len(f) >= 1 {
				kb, _ := strconv.ParseInt(f[0], 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat CPU times (100 on every Linux ABI Go runs on).
const clockTicks = 100

// procCPU reads utime+stime of pid from /proc.
func procCPU(pid int) (time.Duration, bool) {
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, false
	}
	// The command name (field 2) is parenthesized and may contain spaces: parse after the last ')'.
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(s[i+1:])
	// f[0] is field 3 (state); utime and stime are fields 14 and 15.
	if len(f) < 13 {
		return 0, false
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return time.Duration(ut+st) * time.Second / clockTicks, true
}

// stop asks the child to stop (SIGTERM), waits up to 10 s, then kills it. It returns the child's
// whole-lifetime CPU time from its rusage.
func (p *kveppProcess) stop() error {
	if !p.exited() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	}
	_ = p.stdin.Close()
	_ = p.log.Close()
	var ee *exec.ExitError
	if p.err != nil && !errors.As(p.err, &ee) {
		return p.err
	}
	if p.err != nil {
		return fmt.Errorf("kvepp exited with %v", p.err)
	}
	return nil
}

// lifetimeCPU returns the exited child's user+system CPU time from its rusage.
func (p *kveppProcess) lifetimeCPU() time.Duration {
	if p.cmd.ProcessState == nil {
		return 0
	}
	return p.cmd.ProcessState.UserTime() + p.cmd.ProcessState.SystemTime()
}

// scrapeMetrics fetches kvepp's Prometheus text and returns the samples whose metric name starts
// with one of prefixes, keyed by the sample's name and labels as written.
func scrapeMetrics(addr string, prefixes ...string) (map[string]float64, error) {
	client := &http.Client{Timeout: 5 * time.Second}
	resp, err := client.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			continue
		}
		for _, p := range prefixes {
			if !strings.HasPrefix(line, p) {
				continue
			}
			i := strings.LastIndexByte(line, ' ')
			if i < 0 {
				break
			}
			if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
				out[line[:i]] = v
			}
			break
		}
	}
	return out, sc.Err()
}

// tail returns the last lines of a log file, for error messages.
func tail(path string) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	s := strings.TrimSpace(string(data))
	lines := strings.Split(s, "\n")
	if len(lines) > 5 {
		lines = lines[len(lines)-5:]
	}
	return strings.Join(lines, " | ")
}

// policyConfig renders the generated worker_selection YAML from the baselines' instances (see
// policyInstances: a parameterless policy is one instance named after its type, an entry with
// parameters gets its own instance, --policy-config instances are copied), so every baseline is
// selected by name through the catalog's override resolution (DYN_ROUTER_WORKER_SELECTION_POLICY;
// selection-service.md §18.1).
func policyConfig(instances []catalog.Instance) ([]byte, error) {
	// No default: a router that selects no instance runs what the EPP runs out of the box.
	cfg := catalog.Config{WorkerSelection: &catalog.WorkerSelection{Instances: instances}}
	data, err := yaml.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	// Parse it back as kvepp will, so a bad name fails here with the catalog's message.
	if _, err := catalog.ParseConfig(data); err != nil {
		return nil, err
	}
	return data, nil
}

// validatePolicies resolves every baseline's instance through the catalog before anything starts,
// so an unknown policy name fails fast with the registered type list.
func validatePolicies(reg *catalog.Registry, yamlDoc []byte, instances []string) error {
	cfg, err := catalog.ParseConfig(yamlDoc)
	if err != nil {
		return err
	}
	for _, in := range instances {
		if _, err := catalog.Resolve(reg, cfg, in); err != nil {
			return err
		}
	}
	return nil
}
