package runner

import (
	"context"
	"errors"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/picker"
	"github.com/kvepp/kvepp/runner/selectservice"
)

// recoveryRoundPause is the wait between two rounds over the peers (epp.md §11.1 step 4).
const recoveryRoundPause = time.Second

// recoveryThreads is how many partitions of a recovered dump are restored at once.
const recoveryThreads = selectservice.DefaultThreads

// recoverIndex seeds the core's prefix indexes from a peer's GET /dump (epp.md §11.1 step 4,
// selection-service.md §16 step 4): peers are tried in random order, rounds 1 s apart, until one
// answers with a dump within DYN_EPP_RECOVERY_MAX_BYTES / DYN_EPP_RECOVERY_MAX_EVENTS or
// DYN_EPP_RECOVERY_TIMEOUT_SECS elapses (selectservice.RecoverFrom: the dump is decoded as it
// arrives, entries bad on their own are skipped and logged). It reports whether a snapshot was
// applied. Failures are logged and leave the service empty; they never stop startup.
func recoverIndex(ctx context.Context, svc *picker.Service, peers []string, cfg Config, log zerolog.Logger) bool {
	if len(peers) == 0 {
		return false
	}
	timeout := cfg.RecoveryTimeout.Duration()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	client := &http.Client{}
	for round := 1; ; round++ {
		order := rand.Perm(len(peers))
		for _, i := range order {
			err := selectservice.RecoverFrom(ctx, svc, client, peers[i], cfg.dumpLimits(), recoveryThreads, log)
			if err == nil {
				return true
			}
			ev := log.Warn().Err(err).Str("peer", excerpt.Of(peers[i])).Int("round", round)
			if errors.Is(err, picker.ErrDumpTooLarge) {
				ev.Int64("max_bytes", cfg.RecoveryMaxBytes).Int("max_events", cfg.RecoveryMaxEvents).
					Msg("index recovery: peer /dump refused: over DYN_EPP_RECOVERY_MAX_BYTES or DYN_EPP_RECOVERY_MAX_EVENTS; trying the next peer")
			} else {
				ev.Msg("index recovery: peer /dump failed")
			}
			if ctx.Err() != nil {
				break
			}
		}
		t := time.NewTimer(recoveryRoundPause)
		select {
		case <-ctx.Done():
			t.Stop()
			log.Warn().Int64("timeout_ms", timeout.Milliseconds()).Msg("index recovery gave up: no peer answered /dump within its bounds; starting with an empty index")
			return false
		case <-t.C:
		}
	}
}
