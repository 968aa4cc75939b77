package runner

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/picker"
)

// maxDumpBytes bounds a peer's /dump response (1 GiB).
const maxDumpBytes = 1 << 30

// recoveryRoundPause is the wait between two rounds over the peers (epp.md §11.1 step 4).
const recoveryRoundPause = time.Second

// recoverIndex seeds the core's prefix indexes from a peer's GET /dump (epp.md §11.1 step 4,
// selection-service.md §16 step 4): peers are tried in random order, rounds 1 s apart, until one
// answers or timeout elapses. It reports whether a snapshot was applied. Failures are logged and
// leave the service empty; they never stop startup.
func recoverIndex(ctx context.Context, svc *picker.Service, peers []string, timeout time.Duration, log zerolog.Logger) bool {
	if len(peers) == 0 {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	client := &http.Client{}
	for round := 1; ; round++ {
		order := rand.Perm(len(peers))
		for _, i := range order {
			peer := strings.TrimRight(peers[i], "/")
			dump, err := fetchDump(ctx, client, peer)
			if err != nil {
				log.Warn().Err(err).Str("peer", peer).Int("round", round).Msg("index recovery: peer /dump failed")
				if ctx.Err() != nil {
					break
				}
				continue
			}
			applied, failed := 0, 0
			for key, part := range dump {
				pk, err := picker.ParsePartitionKey(key)
				if err != nil {
					log.Warn().Err(err).Str("peer", peer).Msg("index recovery: skipping partition")
					failed++
					continue
				}
				if err := svc.RestorePartition(pk, part.BlockSize, part.Events); err != nil {
					log.Warn().Err(err).Str("peer", peer).Str("partition", key).Msg("index recovery: partition restore incomplete")
					failed++
					continue
				}
				applied++
			}
			log.Info().Str("peer", peer).Int("partitions", applied).Int("failed", failed).Msg("index recovered from peer /dump")
			return true
		}
		t := time.NewTimer(recoveryRoundPause)
		select {
		case <-ctx.Done():
			t.Stop()
			log.Warn().Int64("timeout_ms", timeout.Milliseconds()).Msg("index recovery gave up: no peer answered /dump; starting with an empty index")
			return false
		case <-t.C:
		}
	}
}

// fetchDump GETs <peer>/dump and decodes it.
func fetchDump(ctx context.Context, client *http.Client, peer string) (map[string]picker.PartitionDump, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, peer+"/dump", nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return nil, fmt.Errorf("GET %s/dump: status %d: %s", peer, resp.StatusCode, strings.TrimSpace(string(body)))
	}
	var dump map[string]picker.PartitionDump
	dec := json.NewDecoder(io.LimitReader(resp.Body, maxDumpBytes))
	if err := dec.Decode(&dump); err != nil {
		return nil, fmt.Errorf("GET %s/dump: invalid body: %w", peer, err)
	}
	return dump, nil
}
