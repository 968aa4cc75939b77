package extproc

import (
	"github.com/kvepp/kvepp/internal/excerpt"
	"github.com/kvepp/kvepp/picker"
)

// ModelCatalog is what resolving a request's model reads: the served partition models
// (*picker.Service implements it, and so does every Picker).
type ModelCatalog interface {
	// HasModel reports whether a partition of model exists (epp.md §5.5).
	HasModel(model string) bool
	// Models lists the served partition models.
	Models() []string
}

// ResolveBodyModel resolves the body "model" of a tokenized request exactly as the ext_proc
// server does (epp.md §5.5; README "How a request finds its model"), for callers outside a stream
// such as POST /tokenize: model is the body's model ("" when the body names none), defaultModel is
// DYN_MODEL_NAME. It returns the partition whose tokenizer applies and the LoRA adapter name (""
// for none). Errors are *picker.Error: KindBadRequest for a name picker.ValidateName refuses or
// a request naming no model while several are served, KindModelNotFound for a model neither
// served nor covered by defaultModel, picker.KindNotReady when no model is served at all.
func ResolveBodyModel(c ModelCatalog, defaultModel, model string) (partition, lora string, err error) {
	return resolveModel(c, defaultModel, namedModel{name: model, field: "model", fromBody: true}, false)
}

// resolveModel implements the partition and LoRA rows of epp.md §5.5 for the model m a request
// names: a served model is its own partition; else DYN_MODEL_NAME's partition (defaultModel),
// with a body model as the LoRA adapter; a request naming no model uses the only served model. A
// model named but neither served nor covered by DYN_MODEL_NAME is a 404. A request naming no
// model while several are served is a 400 — except for a load-only pick (loadOnly), which then
// chooses among every model's workers ("") because nothing in the request can tell them apart.
// The name must pass picker.ValidateName (400).
func resolveModel(c ModelCatalog, defaultModel string, m namedModel, loadOnly bool) (partition, lora string, err error) {
	if m.name != "" {
		if err := picker.ValidateName(m.field, m.name); err != nil {
			return "", "", err
		}
	}
	if m.name != "" && c.HasModel(m.name) {
		return m.name, "", nil
	}
	if defaultModel != "" {
		if m.fromBody && m.name != defaultModel {
			lora = m.name
		}
		return defaultModel, lora, nil
	}
	if m.name != "" {
		return "", "", picker.Errorf(KindModelNotFound, "model %q is not served", excerpt.Of(m.name))
	}
	switch ms := c.Models(); {
	case len(ms) == 1:
		return ms[0], "", nil
	case loadOnly:
		return "", "", nil
	case len(ms) == 0:
		return "", "", picker.Errorf(picker.KindNotReady, "no model is served: no worker is registered")
	default:
		return "", "", picker.Errorf(picker.KindBadRequest,
			"the request names no model and %d models are served; set \"model\" (or DYN_MODEL_NAME)", len(ms))
	}
}
