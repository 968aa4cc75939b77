package picker_test

import (
	"strings"
	"testing"

	"github.com/kvepp/kvepp/picker"
)

func TestParsePartitionKey(t *testing.T) {
	tests := []struct {
		name, key string
		want      picker.PartitionKey
		wantErr   bool
	}{
		{"a plain key splits at the colon", "m:default", picker.PartitionKey{ModelName: "m", RoutingGroup: "default"}, false},
		{"a model name with a colon keeps it", "llama3:8b:g1", picker.PartitionKey{ModelName: "llama3:8b", RoutingGroup: "g1"}, false},
		{"a key without a colon is rejected", "model", picker.PartitionKey{}, true},
		{"a key with an empty group is rejected", "model:", picker.PartitionKey{}, true},
		{"a key with an empty model is rejected", ":group", picker.PartitionKey{}, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := picker.ParsePartitionKey(tc.key)
			if (err != nil) != tc.wantErr || got != tc.want {
				t.Fatalf("got %+v, %v", got, err)
			}
		})
	}
}

// TestEveryAcceptedPartitionRoundTripsThroughItsDumpKey checks that the names ValidateName accepts
// make /dump keys that parse back to exactly their partition, so no two partitions share a key.
func TestEveryAcceptedPartitionRoundTripsThroughItsDumpKey(t *testing.T) {
	names := []string{"a", "a:b", "b:c", "llama3:8b", ":", "x:", ":y", "::", "a b", "модель", "%3A", "a/b:c", "default",
		strings.Repeat("z", picker.MaxNameBytes), strings.Repeat(":", picker.MaxNameBytes)}
	seen := map[string]picker.PartitionKey{}
	for _, model := range names {
		for _, group := range names {
			if picker.ValidateName("model_name", model) != nil || picker.ValidateName("routing_group", group) != nil {
				continue
			}
			k := picker.PartitionKey{ModelName: model, RoutingGroup: group}
			got, err := picker.ParsePartitionKey(k.String())
			if err != nil || got != k {
				t.Fatalf("%+v: key %q parses to %+v, %v", k, k.String(), got, err)
			}
			if prev, dup := seen[k.String()]; dup {
				t.Fatalf("%+v and %+v share the key %q", prev, k, k.String())
			}
			seen[k.String()] = k
		}
	}
	if len(seen) < 20 {
		t.Fatalf("only %d partitions were accepted", len(seen))
	}
}

func TestValidateName(t *testing.T) {
	for _, tc := range []struct {
		field, name, wantErr string
	}{
		{"model_name", "Qwen/Qwen3-0.6B", ""},
		{"model_name", "llama3:8b", ""},
		{"model_name", "", ""},
		{"model_name", strings.Repeat("a", 256), ""},
		{"model_name", strings.Repeat("a", 257), "model_name is 257 bytes long; the limit is 256 bytes"},
		{"model_name", "m\xff", `model_name "m\xff" is not valid UTF-8`},
		{"model_name", "m\uFFFD", "U+FFFD"},
		{"model_name", "m\x00", "control character U+0000"},
		{"routing_group", "\u0085", "control character U+0085"},
		{"routing_group", "b:c", "must not contain ':'"},
	} {
		err := picker.ValidateName(tc.field, tc.name)
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%s %q: %v", tc.field, tc.name, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr) || picker.KindOf(err) != picker.KindBadRequest):
			t.Errorf("%s %q: error %v, want a bad request containing %q", tc.field, tc.name, err, tc.wantErr)
		}
	}
}
