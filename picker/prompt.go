package picker

import (
	"math/rand/v2"
	"slices"

	"github.com/kvepp/kvepp/kvindex"
)

// normPrompt is a request's prompt after normalisation (selection-service.md §6).
type normPrompt struct {
	// local are the local block hashes (index lookups, approximate recording); recordable is false
	// for a hash-form prompt without block_hashes.
	local      []uint64
	recordable bool
	// seq are the tracking hashes booked as active blocks.
	seq []uint64
	// isl is the input length in tokens.
	isl uint64
}

// validateHashForm applies the §6.3 checks to a hash-form prompt (400 messages, in table order),
// plus the MaxISLTokens bound on isl_tokens.
// Token-form prompts pass (their checks need the partition's block size).
func validateHashForm(pr *Prompt) error { return checkHashForm(pr, true) }

// checkHashForm is the §6.3 hash-form check shared by selections (validateHashForm) and explicit
// reservations (validateExplicitPrompt): block_hashes is required only when requireBlockHashes;
// when present its length must match sequence_hashes. Token-form prompts pass.
func checkHashForm(pr *Prompt, requireBlockHashes bool) error {
	if !pr.HashForm {
		return nil
	}
	switch {
	case requireBlockHashes && pr.BlockHashes == nil:
		return Errorf(KindBadRequest, "block_hashes is required without token_ids")
	case pr.SequenceHashes == nil:
		return Errorf(KindBadRequest, "sequence_hashes is required without token_ids")
	case !pr.ISLTokensSet && pr.ISLTokens == 0:
		return Errorf(KindBadRequest, "isl_tokens is required without token_ids")
	case pr.ISLTokens == 0:
		return Errorf(KindBadRequest, "isl_tokens must be greater than 0")
	case pr.ISLTokens > MaxISLTokens:
		return Errorf(KindBadRequest, "isl_tokens %d exceeds the limit of %d tokens", pr.ISLTokens, MaxISLTokens)
	case pr.BlockHashes != nil && len(pr.BlockHashes) != len(pr.SequenceHashes):
		return Errorf(KindBadRequest, "block_hashes length %d must match sequence_hashes length %d",
			len(pr.BlockHashes), len(pr.SequenceHashes))
	}
	return nil
}

// normalizePrompt turns pr into lookup and tracking hashes for a partition with block size bs and
// eagle hashing eagle (§6.1, §6.2; kv-events-index.md §1-§3). Token form: local hashes salted with
// lora_name/cache_salt (and the per-block mm hashes), tracking hashes = the sequence-hash chain,
// or fresh random u64 per block when assumeReuse is false, isl = number of tokens. Hash form: used
// as given. Errors: KindBadRequest with the §6.3 messages, "token_ids must not be empty", and
// prompts over MaxISLTokens.
func normalizePrompt(pr *Prompt, bs uint32, eagle bool, assumeReuse bool) (normPrompt, error) {
	if pr.HashForm {
		if err := validateHashForm(pr); err != nil {
			return normPrompt{}, err
		}
		return normPrompt{local: pr.BlockHashes, recordable: true, seq: pr.SequenceHashes, isl: pr.ISLTokens}, nil
	}
	if len(pr.TokenIDs) == 0 {
		return normPrompt{}, Errorf(KindBadRequest, "token_ids must not be empty")
	}
	if len(pr.TokenIDs) > MaxISLTokens {
		return normPrompt{}, Errorf(KindBadRequest, "token_ids holds %d tokens; the limit is %d tokens", len(pr.TokenIDs), MaxISLTokens)
	}
	if pr.IsEagle != nil {
		eagle = *pr.IsEagle
	}
	seed := kvindex.Seed(pr.LoraName, pr.CacheSalt)
	mm := pr.BlockMMHashes
	if mm == nil && len(pr.MMItems) > 0 {
		mm = blockMMHashes(pr.MMItems, len(pr.TokenIDs), bs)
	}
	var local, seq []uint64
	switch {
	case eagle:
		local = kvindex.EagleBlockHashes(pr.TokenIDs, int(bs), seed, mm)
	case pr.HashMemo != nil && mm == nil && bs > 0:
		local, seq = memoBlockHashes(pr.HashMemo, pr.TokenIDs, bs, seed)
	default:
		local = kvindex.AppendBlockHashes(nil, pr.TokenIDs, int(bs), seed, mm)
	}
	np := normPrompt{local: local, recordable: true, isl: uint64(len(pr.TokenIDs))}
	if assumeReuse {
		np.seq = seq
		if np.seq == nil {
			np.seq = kvindex.SequenceHashes(local)
		}
	} else if len(local) > 0 {
		np.seq = make([]uint64, len(local))
		for i := range np.seq {
			np.seq[i] = rand.Uint64()
		}
	}
	if np.seq == nil {
		np.seq = []uint64{}
	}
	if np.local == nil {
		np.local = []uint64{}
	}
	return np, nil
}

// memoBlockHashes returns the local block hashes of tokens and their sequence hashes, taking those
// of the memo's prefix from the memo (and storing them there when it lacks some).
func memoBlockHashes(memo BlockHashMemo, tokens []uint32, bs uint32, seed uint64) (local, seq []uint64) {
	key := BlockHashKey{BlockSize: bs, Seed: seed}
	blocks := len(tokens) / int(bs)
	memoBlocks := min(memo.Tokens(), len(tokens)) / int(bs)
	kl, ks := memo.LoadBlockHashes(key)
	known := min(len(kl), len(ks), memoBlocks)
	local = make([]uint64, known, blocks)
	seq = make([]uint64, known, blocks)
	copy(local, kl)
	copy(seq, ks)
	local = kvindex.AppendBlockHashes(local, tokens[known*int(bs):blocks*int(bs)], int(bs), seed, nil)
	if known > 0 {
		seq = kvindex.AppendSequenceHashesAfter(seq, seq[known-1], local[known:])
	} else {
		seq = kvindex.AppendSequenceHashes(seq, local)
	}
	if known < memoBlocks {
		// The memo keeps these slices: nothing writes to a prompt's hashes once computed (they are
		// looked up, recorded and booked), and the cap stops an append from reaching them.
		memo.StoreBlockHashes(key, slices.Clip(local[:memoBlocks]), slices.Clip(seq[:memoBlocks]))
	}
	return local, seq
}
