package picker

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/kvepp/kvepp/internal/excerpt"
)

// Input bounds. Ids and names become map keys, ledger and /dump keys and URL path segments, so
// each is bounded where it enters (registration and booking) with a 400 that states the limit; the
// limits are far above anything a real client sends.
const (
	// MaxIDBytes bounds a selection_id and a session id (session_id, session_context.session_id,
	// parent_session_id): 256 bytes, the session-affinity bound of selection-service.md §12.1.
	MaxIDBytes = 256
	// MaxNameBytes bounds a model_name and a routing_group: 256 bytes.
	MaxNameBytes = 256
	// MaxISLTokens bounds a prompt's input length in tokens: isl_tokens of the hash form and the
	// number of token_ids of the token form, 16,777,216 (2^24).
	MaxISLTokens = 1 << 24
)

// ValidateName checks a partition name — field is "model_name" or "routing_group" — as every
// request and registration carries it: at most MaxNameBytes bytes of valid UTF-8 without control
// characters (Unicode class Cc: C0, DEL, C1) and without U+FFFD (which is what a JSON decoder makes
// of invalid UTF-8 or a lone surrogate escape, so two different raw names would otherwise merge
// into one). A routing_group may not contain ':', because a /dump key "<model_name>:<routing_group>"
// is split at its last ':' (kv-events-index.md §14.3); model names may ("llama3:8b"). The empty
// name is valid (it means "default"). The error is KindBadRequest naming the field and the rule,
// quoting at most 100 bytes of the name.
func ValidateName(field, name string) error {
	if len(name) > MaxNameBytes {
		return Errorf(KindBadRequest, "%s is %d bytes long; the limit is %d bytes", field, len(name), MaxNameBytes)
	}
	if why := nameProblem(name); why != "" {
		return Errorf(KindBadRequest, "%s %q %s", field, excerpt.Of(name), why)
	}
	if field == "routing_group" && strings.Contains(name, ":") {
		return Errorf(KindBadRequest, "routing_group %q must not contain ':' (a /dump key is <model_name>:<routing_group>, split at its last ':')",
			excerpt.Of(name))
	}
	return nil
}

// nameProblem says why name is not valid UTF-8 text without control characters, or "".
func nameProblem(name string) string {
	if !utf8.ValidString(name) {
		return "is not valid UTF-8"
	}
	for _, r := range name {
		switch {
		case r == utf8.RuneError:
			return "is not valid UTF-8 (it holds U+FFFD, the replacement for invalid bytes or a lone surrogate escape)"
		case unicode.IsControl(r):
			return fmt.Sprintf("holds the control character %U", r)
		}
	}
	return ""
}

// validatePartition checks a request's or record's model_name and routing_group (ValidateName).
func validatePartition(model, group string) error {
	if err := ValidateName("model_name", model); err != nil {
		return err
	}
	return ValidateName("routing_group", group)
}

// validateRequestIDs checks what a selection or booking request turns into keys: its partition
// names and selection id, and its session ids (the session-affinity table's keys, §12.1). With
// affinity on (affinityOn) an over-long session_id is left to checkSession, which answers with the
// spec's message.
func validateRequestIDs(key PartitionKey, selectionID string, sc *SessionContext, affinityOn bool) error {
	if err := validatePartition(key.ModelName, key.RoutingGroup); err != nil {
		return err
	}
	if err := validateID("selection_id", selectionID); err != nil {
		return err
	}
	if sc == nil {
		return nil
	}
	if !affinityOn {
		if err := validateID("session_id", sc.SessionID); err != nil {
			return err
		}
	}
	return validateID("parent_session_id", sc.ParentSessionID)
}

// validateID checks an id (field "selection_id", "session_id", …) against MaxIDBytes: a
// KindBadRequest stating the limit.
func validateID(field, id string) error {
	if len(id) > MaxIDBytes {
		return Errorf(KindBadRequest, "%s is %d bytes long; the limit is %d bytes", field, len(id), MaxIDBytes)
	}
	return nil
}

// ParsePartitionKey is the inverse of PartitionKey.String for every key this service produces:
// a /dump key "<model_name>:<routing_group>" is split at its last ':' (model names may contain
// ':', routing groups may not; ValidateName). The error names the key (at most 100 bytes of it)
// when it has no ':' or either side is empty.
func ParsePartitionKey(key string) (PartitionKey, error) {
	i := strings.LastIndexByte(key, ':')
	if i <= 0 || i == len(key)-1 {
		return PartitionKey{}, fmt.Errorf("dump key %q is not <model_name>:<routing_group>", excerpt.Of(key))
	}
	return PartitionKey{ModelName: key[:i], RoutingGroup: key[i+1:]}, nil
}

// errNoPartitionWorkers is the detail of a 503 for a partition without a schedulable worker
// (selection-service.md §2.1 "no schedulable workers for {model}:{group}"), saying which case it
// is: no partition of that name (naming up to maxListedModels registered models), or a partition
// whose workers are all unschedulable (with each one's lifecycle and reasons).
func (s *Service) errNoPartitionWorkers(key PartitionKey) error {
	name := excerpt.Of(key.String())
	msg := "no schedulable workers for " + name
	members := s.Workers(key.ModelName, key.RoutingGroup)
	if len(members) == 0 {
		return Errorf(KindNotReady, "%s: there is no partition %s (%s)", msg, name, s.registeredModels())
	}
	parts := make([]string, 0, min(len(members), maxListedModels))
	for i, w := range members {
		if i == maxListedModels {
			parts = append(parts, fmt.Sprintf("and %d more", len(members)-i))
			break
		}
		why := w.Lifecycle
		if len(w.NotSchedulableReasons) > 0 {
			why = strings.Join(w.NotSchedulableReasons, "; ")
		}
		parts = append(parts, fmt.Sprintf("worker %d: %s", w.WorkerID, why))
	}
	if len(members) == 1 {
		return Errorf(KindNotReady, "%s: its only worker is not schedulable (%s)", msg, parts[0])
	}
	return Errorf(KindNotReady, "%s: none of its %d workers is schedulable (%s)", msg, len(members), strings.Join(parts, "; "))
}

// maxListedModels bounds the models or workers a not-ready message lists.
const maxListedModels = 5

// registeredModels names up to maxListedModels registered models for a not-ready message.
func (s *Service) registeredModels() string {
	ms := s.Models()
	if len(ms) == 0 {
		return "no model is registered"
	}
	shown := make([]string, 0, maxListedModels)
	for _, m := range ms[:min(len(ms), maxListedModels)] {
		shown = append(shown, excerpt.Of(m))
	}
	out := "registered models: " + strings.Join(shown, ", ")
	if len(ms) > len(shown) {
		out += fmt.Sprintf(" and %d more", len(ms)-len(shown))
	}
	return out
}
