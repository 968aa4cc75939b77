package tokenizer

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
)

// splitTokenizerJSON walks tokenizer.json once with the single-pass parser: model.vocab and
// model.merges (the bulk of an 11 MB file) are decoded directly, and every other section is
// returned as raw JSON for encoding/json. This keeps Load well under the 0.2–0.75 s that
// tokenizer.md measured for a reflection-based decode.
func splitTokenizerJSON(data []byte) (top map[string]json.RawMessage, model map[string]json.RawMessage,
	vocab map[string]uint32, merges [][2]string, err error) {
	p := jsonParser{data: data}
	top = map[string]json.RawMessage{}
	model = map[string]json.RawMessage{}
	err = p.object(func(key string) error {
		if key != "model" {
			raw, err := p.raw()
			top[key] = raw
			return err
		}
		if p.pos >= len(p.data) || p.data[p.pos] != '{' {
			raw, err := p.raw()
			top[key] = raw
			return err
		}
		return p.object(func(mkey string) error {
			switch mkey {
			case "vocab":
				if p.pos < len(p.data) && p.data[p.pos] == '{' {
					vocab = make(map[string]uint32, 1<<16)
					return p.object(func(tok string) error {
						id, err := p.uint32()
						if err != nil {
							return fmt.Errorf("model.vocab[%q]: %w", tok, err)
						}
						vocab[tok] = id
						return nil
					})
				}
			case "merges":
				if p.pos < len(p.data) && p.data[p.pos] == '[' {
					var err error
					merges, err = p.merges()
					return err
				}
			}
			raw, err := p.raw()
			model[mkey] = raw
			return err
		})
	})
	if err == nil {
		p.skipWS()
		if p.pos != len(p.data) {
			err = p.errorf("unexpected data after the top-level JSON value")
		}
	}
	return top, model, vocab, merges, err
}

// object iterates an object's members; fn must consume the value at p.pos.
func (p *jsonParser) object(fn func(key string) error) error {
	p.skipWS()
	if p.pos >= len(p.data) || p.data[p.pos] != '{' {
		return p.errorf("want an object")
	}
	p.pos++
	p.skipWS()
	if p.pos < len(p.data) && p.data[p.pos] == '}' {
		p.pos++
		return nil
	}
	for {
		p.skipWS()
		if p.pos >= len(p.data) || p.data[p.pos] != '"' {
			return p.errorf("want an object key")
		}
		key, err := p.str()
		if err != nil {
			return err
		}
		p.skipWS()
		if p.pos >= len(p.data) || p.data[p.pos] != ':' {
			return p.errorf("want ':' after object key")
		}
		p.pos++
		p.skipWS()
		if err := fn(key); err != nil {
			return err
		}
		p.skipWS()
		if p.pos >= len(p.data) {
			return p.errorf("unexpected end of input in object")
		}
		switch p.data[p.pos] {
		case ',':
			p.pos++
		case '}':
			p.pos++
			return nil
		default:
			return p.errorf("want ',' or '}' in object")
		}
	}
}

// raw validates and returns the next value's bytes.
func (p *jsonParser) raw() (json.RawMessage, error) {
	start := p.pos
	if _, err := p.value(0); err != nil {
		return nil, err
	}
	return json.RawMessage(p.data[start:p.pos]), nil
}

func (p *jsonParser) uint32() (uint32, error) {
	v, err := p.number()
	if err != nil {
		return 0, err
	}
	n, err := strconv.ParseUint(v.s, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("id %s is not a uint32", v.s)
	}
	return uint32(n), nil
}

// merges parses model.merges in either form: "a b" strings or ["a", "b"] pairs.
func (p *jsonParser) merges() ([][2]string, error) {
	out := make([][2]string, 0, 1<<16)
	p.pos++ // '['
	p.skipWS()
	if p.pos < len(p.data) && p.data[p.pos] == ']' {
		p.pos++
		return out, nil
	}
	for {
		p.skipWS()
		if p.pos >= len(p.data) {
			return nil, p.errorf("unexpected end of input in model.merges")
		}
		var pair [2]string
		switch p.data[p.pos] {
		case '"':
			s, err := p.str()
			if err != nil {
				return nil, err
			}
			a, b, ok := strings.Cut(s, " ")
			if !ok || strings.Contains(b, " ") {
				return nil, fmt.Errorf("model.merges[%d] %q: want two space-separated tokens", len(out), s)
			}
			pair = [2]string{a, b}
		case '[':
			v, err := p.value(0)
			if err != nil {
				return nil, err
			}
			if len(v.arr) != 2 || v.arr[0].kind != jString || v.arr[1].kind != jString {
				return nil, fmt.Errorf("model.merges[%d]: want a pair of strings", len(out))
			}
			pair = [2]string{v.arr[0].s, v.arr[1].s}
		default:
			return nil, fmt.Errorf("model.merges[%d]: want a string or a pair", len(out))
		}
		out = append(out, pair)
		p.skipWS()
		if p.pos >= len(p.data) {
			return nil, p.errorf("unexpected end of input in model.merges")
		}
		switch p.data[p.pos] {
		case ',':
			p.pos++
		case ']':
			p.pos++
			return out, nil
		default:
			return nil, p.errorf("want ',' or ']' in model.merges")
		}
	}
}
