package picker

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"

	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/kvindex"
)

// Bounds of a recovered /dump (selection-service.md §16 step 4; README "Limits").
const (
	// DefaultDumpMaxBytes is the largest /dump body startup recovery reads: 1 GiB.
	DefaultDumpMaxBytes = 1 << 30
	// DefaultDumpMaxEvents is the most events startup recovery accepts from one /dump:
	// 4,194,304 (about 0.8 GB of JSON, staged in about 0.45 GB before they are applied).
	DefaultDumpMaxEvents = 1 << 22
)

// ErrDumpTooLarge marks a /dump that exceeds its DumpLimits; DecodeDump wraps it with the bound.
var ErrDumpTooLarge = errors.New("the dump exceeds the recovery bound")

// dumpChunkEvents is how many decoded events one staging chunk holds: chunks keep the staged dump
// at its own size (no doubling slice growth) and are restored one after the other.
var dumpChunkEvents = 1 << 16

// DumpLimits bounds what DecodeDump accepts. Zero fields take the defaults.
type DumpLimits struct {
	// MaxBytes bounds the dump's JSON text in bytes (DefaultDumpMaxBytes).
	MaxBytes int64
	// MaxEvents bounds the events of all partitions together (DefaultDumpMaxEvents), skipped
	// partitions included.
	MaxEvents int
}

func (l DumpLimits) withDefaults() DumpLimits {
	if l.MaxBytes <= 0 {
		l.MaxBytes = DefaultDumpMaxBytes
	}
	if l.MaxEvents <= 0 {
		l.MaxEvents = DefaultDumpMaxEvents
	}
	return l
}

// RecoveredDump is a /dump decoded by DecodeDump and staged for Service.RestoreDump: the
// partitions whose entry is valid, in dump order, and the entries that were left out.
type RecoveredDump struct {
	// Partitions are the valid entries.
	Partitions []RecoveredPartition
	// Skipped are the entries left out, each with its reason.
	Skipped []SkippedPartition
	// Events counts every event read, skipped partitions included.
	Events int
}

// RecoveredPartition is one valid /dump entry.
type RecoveredPartition struct {
	// Key is the partition the entry's key "<model_name>:<routing_group>" names.
	Key PartitionKey
	// BlockSize is the entry's block_size in tokens (> 0).
	BlockSize int
	// Events is the number of its events.
	Events int
	// chunks hold the events in order, at most dumpChunkEvents each.
	chunks [][]kvindex.RouterEvent
}

// SkippedPartition is a /dump entry DecodeDump left out: an invalid key, a missing or invalid
// block_size, a value that is not an object, an event that does not decode, or a key seen before.
type SkippedPartition struct {
	// Key quotes the entry's key, at most excerpt.MaxBytes bytes of it; a repeated key is
	// followed by " (second time)".
	Key string
	// Reason says what is wrong with the entry.
	Reason string
}

// DecodeDump reads a GET /dump body (kv-events-index.md §14.3: {"<model>:<group>": {"block_size":
// n, "events": [RouterEvent…]}}) as it arrives, so memory grows with the events kept, never with
// the text: at most lim.MaxBytes bytes are read and at most lim.MaxEvents events accepted, beyond
// which the whole dump is refused (ErrDumpTooLarge naming the bound). An entry that is bad on its
// own is skipped and reported in Skipped (the rest of the dump still counts); unknown fields of an
// entry are ignored. Malformed JSON, a body that is not an object, and a read error refuse the
// whole dump.
func DecodeDump(r io.Reader, lim DumpLimits) (*RecoveredDump, error) {
	lim = lim.withDefaults()
	cr := &cappedReader{r: r, left: lim.MaxBytes}
	d := &dumpDecoder{dec: json.NewDecoder(cr), lim: lim, out: &RecoveredDump{}, seen: map[string]bool{}}
	err := d.decode()
	switch {
	case cr.over:
		return nil, fmt.Errorf("%w: more than %d bytes", ErrDumpTooLarge, lim.MaxBytes)
	case err != nil:
		return nil, err
	}
	return d.out, nil
}

// cappedReader reads at most left bytes of r, then fails with over set.
type cappedReader struct {
	r    io.Reader
	left int64
	over bool
}

var errCapped = errors.New("read bound reached")

func (c *cappedReader) Read(p []byte) (int, error) {
	if c.left <= 0 {
		c.over = true
		return 0, errCapped
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.r.Read(p)
	c.left -= int64(n)
	return n, err
}

type dumpDecoder struct {
	dec  *json.Decoder
	lim  DumpLimits
	out  *RecoveredDump
	seen map[string]bool
}

// decode reads the top-level object.
func (d *dumpDecoder) decode() error {
	if err := d.expectDelim('{', "the dump"); errors.Is(err, io.EOF) {
		return errors.New("the dump body is empty")
	} else if err != nil {
		return err
	}
	for d.dec.More() {
		tok, err := d.dec.Token()
		if err != nil {
			return err
		}
		key, _ := tok.(string) // object keys are strings
		if err := d.partition(key); err != nil {
			return err
		}
	}
	if _, err := d.dec.Token(); err != nil { // the closing '}'
		return err
	}
	if _, err := d.dec.Token(); err != io.EOF {
		if err == nil {
			err = errors.New("the dump has data after its object")
		}
		return err
	}
	return nil
}

// expectDelim reads the next token and requires it to be delim.
func (d *dumpDecoder) expectDelim(delim json.Delim, what string) error {
	tok, err := d.dec.Token()
	if err != nil {
		return err
	}
	if tok != delim {
		return fmt.Errorf("%s is not a JSON %s", what, delimName(delim))
	}
	return nil
}

func delimName(delim json.Delim) string {
	if delim == '{' {
		return "object"
	}
	return "array"
}

// partition reads the value of dump entry key. Only errors that end the whole dump are returned;
// a bad entry is consumed and recorded in Skipped.
func (d *dumpDecoder) partition(key string) error {
	quoted := excerpt.Of(key)
	skip := func(reason string) {
		d.out.Skipped = append(d.out.Skipped, SkippedPartition{Key: quoted, Reason: reason})
	}
	var reason string
	pk, err := ParsePartitionKey(key)
	if err == nil {
		err = validatePartition(pk.ModelName, pk.RoutingGroup)
	}
	switch {
	case err != nil:
		reason = err.Error()
	case d.seen[key]:
		quoted += " (second time)"
		reason = "the key appears twice in the dump"
	}
	d.seen[key] = true

	tok, err := d.dec.Token()
	if err != nil {
		return err
	}
	if tok != json.Delim('{') {
		if err := d.skipRest(tok); err != nil {
			return err
		}
		skip(cmp.Or(reason, "the entry is not an object"))
		return nil
	}
	p := RecoveredPartition{Key: pk}
	haveBlockSize := false
	for d.dec.More() {
		tok, err := d.dec.Token()
		if err != nil {
			return err
		}
		switch field, _ := tok.(string); field {
		case "block_size":
			haveBlockSize = true
			if err := d.dec.Decode(&p.BlockSize); err != nil {
				if fatal(err) {
					return err
				}
				reason = cmp.Or(reason, "block_size: "+err.Error())
			}
		case "events":
			r, err := d.events(&p, reason != "")
			if err != nil {
				return err
			}
			reason = cmp.Or(reason, r)
		default:
			var ignored json.RawMessage
			if err := d.dec.Decode(&ignored); err != nil {
				return err
			}
		}
	}
	if _, err := d.dec.Token(); err != nil { // the entry's closing '}'
		return err
	}
	switch {
	case reason != "":
	case !haveBlockSize:
		reason = "block_size is missing"
	case p.BlockSize <= 0:
		reason = fmt.Sprintf("block_size must be greater than 0, got %d", p.BlockSize)
	}
	if reason != "" {
		skip(reason)
		return nil
	}
	d.out.Partitions = append(d.out.Partitions, p)
	return nil
}

// events reads an entry's events array into p (only counted when discard is set). It returns
// the reason the entry is bad ("" when it is not) or an error that ends the whole dump.
func (d *dumpDecoder) events(p *RecoveredPartition, discard bool) (string, error) {
	tok, err := d.dec.Token()
	if err != nil {
		return "", err
	}
	if tok == nil { // "events": null is an empty list
		return "", nil
	}
	if tok != json.Delim('[') {
		if err := d.skipRest(tok); err != nil {
			return "", err
		}
		return "events is not an array", nil
	}
	reason := ""
	for i := 0; d.dec.More(); i++ {
		if d.out.Events++; d.out.Events > d.lim.MaxEvents {
			return "", fmt.Errorf("%w: more than %d events", ErrDumpTooLarge, d.lim.MaxEvents)
		}
		if discard || reason != "" {
			var ignored json.RawMessage
			if err := d.dec.Decode(&ignored); err != nil {
				return "", err
			}
			continue
		}
		var ev dumpEvent
		if err := d.dec.Decode(&ev); err != nil {
			if fatal(err) {
				return "", err
			}
			reason = fmt.Sprintf("events[%d]: %s", i, excerpt.OfN(err.Error(), 200))
			p.chunks, p.Events = nil, 0
			continue
		}
		if n := len(p.chunks); n == 0 || len(p.chunks[n-1]) == cap(p.chunks[n-1]) {
			p.chunks = append(p.chunks, make([]kvindex.RouterEvent, 0, dumpChunkEvents))
		}
		last := &p.chunks[len(p.chunks)-1]
		*last = append(*last, ev.RouterEvent)
		p.Events++
	}
	if _, err := d.dec.Token(); err != nil { // the closing ']'
		return "", err
	}
	return reason, nil
}

// skipRest consumes the rest of a value whose first token was tok.
func (d *dumpDecoder) skipRest(tok json.Token) error {
	depth := 0
	for {
		if delim, ok := tok.(json.Delim); ok {
			switch delim {
			case '{', '[':
				depth++
			default:
				depth--
			}
		}
		if depth == 0 {
			return nil
		}
		var err error
		if tok, err = d.dec.Token(); err != nil {
			return err
		}
	}
}

// dumpEvent decodes a RouterEvent, marking its validation errors as shapeErrors.
type dumpEvent struct{ kvindex.RouterEvent }

// UnmarshalJSON implements json.Unmarshaler.
func (e *dumpEvent) UnmarshalJSON(b []byte) error {
	if err := e.RouterEvent.UnmarshalJSON(b); err != nil {
		return shapeError{err}
	}
	return nil
}

// shapeError is a well-formed event that is not a valid RouterEvent.
type shapeError struct{ err error }

func (e shapeError) Error() string { return e.err.Error() }
func (e shapeError) Unwrap() error { return e.err }

// fatal reports a decoding error after which the stream cannot go on — malformed JSON, a read
// failure, the byte bound — as opposed to a well-formed value of the wrong shape (a type error,
// an invalid event), which the decoder has stepped over.
func fatal(err error) bool {
	var te *json.UnmarshalTypeError
	var se shapeError
	return !errors.As(err, &te) && !errors.As(err, &se)
}

// RestoreFailure is a partition of a RecoveredDump whose restore was refused or incomplete.
type RestoreFailure struct {
	// Key is the partition.
	Key PartitionKey
	// Err is RestorePartition's error (for an incomplete restore: how many events failed, and
	// the first failure).
	Err error
}

// RestoreDump seeds the partitions of d (selection-service.md §16 step 4) as RestorePartition
// does, threads partitions at a time (threads < 1 counts as 1), each one's events in dump order.
// It returns the partitions that were refused or only partly restored, sorted by key.
func (s *Service) RestoreDump(d *RecoveredDump, threads int) []RestoreFailure {
	sem := make(chan struct{}, max(threads, 1))
	var (
		mu    sync.Mutex
		fails []RestoreFailure
		wg    sync.WaitGroup
	)
	for i := range d.Partitions {
		p := &d.Partitions[i]
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if err := s.restoreChunks(p); err != nil {
				mu.Lock()
				fails = append(fails, RestoreFailure{Key: p.Key, Err: err})
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	slices.SortFunc(fails, func(a, b RestoreFailure) int { return strings.Compare(a.Key.String(), b.Key.String()) })
	return fails
}

// restoreChunks restores one staged partition chunk by chunk, releasing each chunk once applied.
func (s *Service) restoreChunks(p *RecoveredPartition) error {
	index, err := s.prepareRestore(p.Key, p.BlockSize)
	if err != nil {
		return err
	}
	var first error
	failedChunks := 0
	for i, chunk := range p.chunks {
		if err := s.restoreInto(index, chunk); err != nil {
			failedChunks++
			if first == nil {
				first = err
			}
		}
		p.chunks[i] = nil
	}
	if first != nil && len(p.chunks) > 1 {
		return fmt.Errorf("%d of %d chunks of %d events had failed events; the first: %w", failedChunks, len(p.chunks), dumpChunkEvents, first)
	}
	return first
}
