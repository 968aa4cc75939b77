package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// loadOptions are the settings of `eppbench load`, one per flag (loadFlags gives each meaning).
type loadOptions struct {
	Targets     []loadTarget
	Bodies      []string
	Concurrency []int
	Unique      bool
	Duration    time.Duration
	Warmup      time.Duration
	Rounds      int
	Shared      string
	JSON        string
	TLS         bool
}

// loadTarget is one ext_proc server under test.
type loadTarget struct {
	Name, Addr string
	// PID, when > 0, is the server's process id on this machine: its CPU per exchange is reported
	// (from /proc/<pid>/stat).
	PID int
}

// loadCell is the measurement of one (body, concurrency, target), accumulated over rounds.
type loadCell struct {
	Body        string  `json:"body"`
	Turns       int     `json:"turns"`
	BodyBytes   int     `json:"body_bytes"`
	Concurrency int     `json:"concurrency"`
	Target      string  `json:"target"`
	Exchanges   int     `json:"exchanges"`
	Errors      int     `json:"errors"`
	FirstError  string  `json:"first_error,omitempty"`
	Seconds     float64 `json:"seconds"`
	PerSecond   float64 `json:"exchanges_per_second"`
	// DecisionP50Ms … are milliseconds.
	DecisionP50Ms float64 `json:"decision_p50_ms"`
	DecisionP99Ms float64 `json:"decision_p99_ms"`
	ExchangeP50Ms float64 `json:"exchange_p50_ms"`
	ExchangeP99Ms float64 `json:"exchange_p99_ms"`
	// ClientCPUUs is the load generator's own CPU per exchange, µs (the same work for every target).
	ClientCPUUs float64 `json:"client_cpu_us_per_exchange"`
	// ServerCPUUs is the server's CPU per exchange, µs, when its --pid is known (else 0).
	ServerCPUUs float64 `json:"server_cpu_us_per_exchange,omitempty"`

	decisions, totals []time.Duration
	cpu, serverCPU    time.Duration
}

const loadUsage = `usage: eppbench load --target NAME=HOST:PORT [--target …] [flags]

Plays full ext_proc exchanges (request headers, body, routing reply, response phase) from
concurrent streams against one or more running ext_proc servers, side by side: every round runs
each (body, concurrency) cell against every target in turn. The table gives exchanges/s and the
decision and exchange percentiles per target, and each target's ratio to the last target (the
floor, e.g. the Gateway API Inference Extension's lightweight EPP).

Bodies (--body, repeatable): a golden vector of ../shared/golden/qwen3-requests.json (chat-long),
@FILE (a JSON request body), or conv:turns=N[,turn-bytes=B][,model=M] (a synthetic chat of N user
turns of about B bytes each, default 7680, with assistant replies between them).

Flags:
`

// parseLoadFlags reads the arguments of `eppbench load`.
func parseLoadFlags(args []string, stderr io.Writer) (loadOptions, error) {
	o := loadOptions{Unique: true, Duration: 5 * time.Second, Warmup: time.Second, Rounds: 3, Shared: "../shared"}
	fs := flag.NewFlagSet("eppbench load", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, loadUsage)
		fs.PrintDefaults()
	}
	fs.Func("target", "NAME=HOST:PORT of a plaintext ext_proc server (repeatable; the last is the floor the ratios divide by)", func(v string) error {
		name, addr, ok := strings.Cut(v, "=")
		if !ok || name == "" || addr == "" {
			return fmt.Errorf("want NAME=HOST:PORT, got %q", v)
		}
		for _, t := range o.Targets {
			if t.Name == name {
				return fmt.Errorf("--target %s: the name %q is given twice", v, name)
			}
		}
		o.Targets = append(o.Targets, loadTarget{Name: name, Addr: addr})
		return nil
	})
	fs.Func("pid", "NAME=PID: the process id of target NAME on this machine, to report its CPU per exchange (repeatable; after that --target)", func(v string) error {
		name, pid, ok := strings.Cut(v, "=")
		n, err := strconv.Atoi(pid)
		if !ok || err != nil || n <= 0 {
			return fmt.Errorf("want NAME=PID, got %q", v)
		}
		for i := range o.Targets {
			if o.Targets[i].Name == name {
				o.Targets[i].PID = n
				return nil
			}
		}
		return fmt.Errorf("--pid %s: no --target named %q before it", v, name)
	})
	fs.Func("body", "request body: golden vector name, @FILE or conv:turns=N[,turn-bytes=B] (repeatable; default chat-long)", func(v string) error {
		o.Bodies = append(o.Bodies, v)
		return nil
	})
	conc := "1,8"
	fs.StringVar(&conc, "concurrency", conc, "comma list of concurrent streams")
	fs.BoolVar(&o.Unique, "unique", o.Unique, "make the last message unique per request (a marker at the start of its text); false sends identical bodies")
	fs.DurationVar(&o.Duration, "duration", o.Duration, "measured time per cell and round")
	fs.DurationVar(&o.Warmup, "warmup", o.Warmup, "unmeasured exchanges before each cell")
	fs.IntVar(&o.Rounds, "rounds", o.Rounds, "rounds; each round measures every cell against every target in turn")
	fs.StringVar(&o.Shared, "shared", o.Shared, "the shared data directory (golden vectors)")
	fs.StringVar(&o.JSON, "json", "", "also write the cells as JSON to this file")
	fs.BoolVar(&o.TLS, "tls", false, "speak TLS without verifying the certificate (kvepp's default self-signed serving)")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if len(o.Targets) == 0 {
		return o, errors.New("--target NAME=HOST:PORT is required")
	}
	if len(o.Bodies) == 0 {
		o.Bodies = []string{"chat-long"}
	}
	for _, f := range strings.Split(conc, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || n > 4096 {
			return o, fmt.Errorf("--concurrency %q: want a comma list of integers in 1..4096", conc)
		}
		o.Concurrency = append(o.Concurrency, n)
	}
	switch {
	case o.Duration <= 0:
		return o, errors.New("--duration must be > 0")
	case o.Warmup < 0:
		return o, errors.New("--warmup must be ≥ 0")
	case o.Rounds < 1:
		return o, errors.New("--rounds must be ≥ 1")
	}
	return o, nil
}

// runLoadCommand is `eppbench load`: it returns the process exit status (0 ok, 1 failed or some
// exchanges failed, 2 bad flags).
func runLoadCommand(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseLoadFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "eppbench load:", err)
		return 2
	}
	cells, err := runLoad(ctx, o, stderr)
	if len(cells) > 0 {
		writeLoadTable(stdout, cells, o.Targets)
	}
	if o.JSON != "" && len(cells) > 0 {
		data, _ := json.MarshalIndent(cells, "", "  ")
		if werr := os.WriteFile(o.JSON, append(data, '\n'), 0o644); werr != nil {
			err = errors.Join(err, werr)
		}
	}
	if err != nil {
		fmt.Fprintln(stderr, "eppbench load:", err)
		return 1
	}
	for _, c := range cells {
		if c.Errors > 0 {
			fmt.Fprintf(stderr, "eppbench load: %s: %d of %d exchanges failed, first: %s\n", c.Target, c.Errors, c.Errors+c.Exchanges, c.FirstError)
			return 1
		}
	}
	return 0
}

// runLoad measures every cell of o, round by round, and returns them in (body, concurrency,
// target) order.
func runLoad(ctx context.Context, o loadOptions, progress io.Writer) ([]*loadCell, error) {
	var bodies []*loadBody
	for _, spec := range o.Bodies {
		b, err := parseLoadBody(spec, o.Shared)
		if err != nil {
			return nil, err
		}
		bodies = append(bodies, b)
	}
	creds := insecure.NewCredentials()
	if o.TLS {
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) // #nosec G402 -- a benchmark against a self-signed EPP
	}
	clients := make([]extprocv3.ExternalProcessorClient, len(o.Targets))
	for i, t := range o.Targets {
		conn, err := grpc.NewClient(t.Addr, grpc.WithTransportCredentials(creds),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(256<<20), grpc.MaxCallSendMsgSize(256<<20)))
		if err != nil {
			return nil, fmt.Errorf("--target %s=%s: %w", t.Name, t.Addr, err)
		}
		defer conn.Close()
		clients[i] = extprocv3.NewExternalProcessorClient(conn)
	}
	run := fmt.Sprintf("r%06x", rand.Uint32()&0xffffff) // distinguishes this run's markers from any earlier run's
	var cells []*loadCell
	for _, b := range bodies {
		for _, c := range o.Concurrency {
			for _, t := range o.Targets {
				cells = append(cells, &loadCell{Body: b.Name, Turns: b.Turns, BodyBytes: len(b.Raw), Concurrency: c, Target: t.Name})
			}
		}
	}
	var seq atomic.Uint64
	for r := 0; r < o.Rounds; r++ {
		i := 0
		for _, b := range bodies {
			for _, c := range o.Concurrency {
				for ti := range o.Targets {
					cell := cells[i]
					i++
					if progress != nil {
						fmt.Fprintf(progress, "eppbench load: round %d/%d %s c=%d %s\n", r+1, o.Rounds, b.Name, c, cell.Target)
					}
					if err := measureCell(ctx, clients[ti], o.Targets[ti].PID, b, c, o, run, &seq, cell); err != nil {
						return cells, err
					}
				}
			}
		}
	}
	for _, c := range cells {
		c.finish()
	}
	return cells, nil
}

// measureCell runs c concurrent streams for o.Warmup (unmeasured) and then o.Duration, adding the
// measured exchanges to cell.
func measureCell(ctx context.Context, client extprocv3.ExternalProcessorClient, pid int, b *loadBody, c int, o loadOptions, run string, seq *atomic.Uint64, cell *loadCell) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	// One exchange first, so an unreachable or misconfigured target fails at once instead of
	// filling the cell with errors.
	probe := loadRequest{Path: b.Path, Body: b.bytesFor(o.Unique, run, seq.Add(1)), RequestID: run + "-probe"}
	if _, err := doExchange(ctx, client, probe); err != nil {
		return fmt.Errorf("target %s: %s: the first exchange failed: %w", cell.Target, b.Name, err)
	}
	var measuring atomic.Bool
	stop := make(chan struct{})
	var mu sync.Mutex
	var wg sync.WaitGroup
	for w := 0; w < c; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var decisions, totals []time.Duration
			errs, first := 0, ""
			for {
				select {
				case <-stop:
					mu.Lock()
					cell.decisions = append(cell.decisions, decisions...)
					cell.totals = append(cell.totals, totals...)
					cell.Errors += errs
					if cell.FirstError == "" {
						cell.FirstError = first
					}
					mu.Unlock()
					return
				case <-ctx.Done():
					return
				default:
				}
				n := seq.Add(1)
				req := loadRequest{Path: b.Path, Body: b.bytesFor(o.Unique, run, n), RequestID: run + "-" + strconv.FormatUint(n, 10)}
				m := measuring.Load()
				t, err := doExchange(ctx, client, req)
				if !m || !measuring.Load() {
					continue // started or ended outside the measured window
				}
				if err != nil {
					if errs++; first == "" {
						first = err.Error()
					}
					continue
				}
				decisions = append(decisions, t.Decision)
				totals = append(totals, t.Total)
			}
		}()
	}
	sleep := func(d time.Duration) {
		select {
		case <-time.After(d):
		case <-ctx.Done():
		}
	}
	sleep(o.Warmup)
	cpu0 := processCPU()
	srv0, srvOK0 := procCPU(pid)
	start := time.Now()
	measuring.Store(true)
	sleep(o.Duration)
	measuring.Store(false)
	elapsed := time.Since(start)
	cpu1 := processCPU()
	if srv1, ok := procCPU(pid); ok && srvOK0 && pid > 0 {
		cell.serverCPU += srv1 - srv0
	}
	close(stop)
	wg.Wait()
	cell.Seconds += elapsed.Seconds()
	cell.cpu += cpu1 - cpu0
	return ctx.Err()
}

// finish turns the accumulated samples into the cell's figures.
func (c *loadCell) finish() {
	c.Exchanges = len(c.totals)
	if c.Seconds > 0 {
		c.PerSecond = float64(c.Exchanges) / c.Seconds
	}
	if c.Exchanges > 0 {
		c.ClientCPUUs = float64(c.cpu.Microseconds()) / float64(c.Exchanges)
		c.ServerCPUUs = float64(c.serverCPU.Microseconds()) / float64(c.Exchanges)
	}
	ms := func(ds []time.Duration, p float64) float64 {
		if len(ds) == 0 {
			return 0
		}
		return float64(ds[int(p*float64(len(ds)-1))].Nanoseconds()) / 1e6
	}
	slices.Sort(c.decisions)
	slices.Sort(c.totals)
	c.DecisionP50Ms, c.DecisionP99Ms = ms(c.decisions, 0.50), ms(c.decisions, 0.99)
	c.ExchangeP50Ms, c.ExchangeP99Ms = ms(c.totals, 0.50), ms(c.totals, 0.99)
}

// processCPU returns this process's user+system CPU time.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// writeLoadTable prints a markdown table with one row per (body, concurrency): each target's
// exchanges/s, decision p50/p99 and exchange p50/p99, every target's ratio to the last target
// (exchanges/s and decision p50), and the load generator's CPU per exchange for each target.
func writeLoadTable(out io.Writer, cells []*loadCell, targets []loadTarget) {
	floor := targets[len(targets)-1].Name
	head := []string{"body", "turns", "KiB", "c"}
	for _, t := range targets {
		head = append(head, t.Name+" exch/s", t.Name+" decision p50 / p99 ms", t.Name+" exchange p50 / p99 ms")
	}
	for _, t := range targets[:len(targets)-1] {
		head = append(head, t.Name+"/"+floor+" exch/s", t.Name+"/"+floor+" decision p50")
	}
	head = append(head, "server CPU µs/exchange", "client CPU µs/exchange")
	line := func(f []string) { fmt.Fprintln(out, "| "+strings.Join(f, " | ")+" |") }
	line(head)
	sep := make([]string, len(head))
	for i := range sep {
		sep[i] = "---"
	}
	line(sep)
	for i := 0; i < len(cells); i += len(targets) {
		row := cells[i : i+len(targets)]
		f := []string{row[0].Body, strconv.Itoa(row[0].Turns), fmt.Sprintf("%.1f", float64(row[0].BodyBytes)/1024), strconv.Itoa(row[0].Concurrency)}
		for _, c := range row {
			pct := fmt.Sprintf("%.0f", c.PerSecond)
			if c.Errors > 0 {
				pct += fmt.Sprintf(" (%d errors)", c.Errors)
			}
			decision, exchange := "-", "-" // no exchange succeeded: there is no latency to show
			if c.Exchanges > 0 {
				decision = fmt.Sprintf("%.3f / %.3f", c.DecisionP50Ms, c.DecisionP99Ms)
				exchange = fmt.Sprintf("%.3f / %.3f", c.ExchangeP50Ms, c.ExchangeP99Ms)
			}
			f = append(f, pct, decision, exchange)
		}
		fl := row[len(row)-1]
		for _, c := range row[:len(row)-1] {
			dr := "-" // a target without a successful exchange has no decision time to compare
			if c.Exchanges > 0 && fl.Exchanges > 0 {
				dr = ratio(c.DecisionP50Ms, fl.DecisionP50Ms)
			}
			f = append(f, ratio(c.PerSecond, fl.PerSecond), dr)
		}
		var srv, cli []string
		for _, c := range row {
			s := "-"
			if c.ServerCPUUs > 0 {
				s = fmt.Sprintf("%.0f", c.ServerCPUUs)
			}
			srv, cli = append(srv, s), append(cli, fmt.Sprintf("%.0f", c.ClientCPUUs))
		}
		f = append(f, strings.Join(srv, " / "), strings.Join(cli, " / "))
		line(f)
	}
}

func ratio(a, b float64) string {
	if b == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2f×", a/b)
}
