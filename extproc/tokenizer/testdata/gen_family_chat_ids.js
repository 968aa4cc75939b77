// Adds reference token ids (npm tokenizers 0.23.2, add_special_tokens=false, as vLLM encodes a
// rendered chat) to family-chat-prompts.json, writing family-chat-golden.json.
//   NODE_PATH=/path/to/node_modules node gen_family_chat_ids.js /tmp/kvepp-tokenizer-models
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('tokenizers');
(async () => {
  const models = process.argv[2] || process.env.KVEPP_TOKENIZER_MODELS || '/tmp/kvepp-tokenizer-models';
  const g = JSON.parse(fs.readFileSync(path.join(__dirname, 'family-chat-prompts.json'), 'utf8'));
  const toks = {};
  for (const fam of Object.values(g.families)) {
    const tok = toks[fam.tokenizer] || (toks[fam.tokenizer] = Tokenizer.fromFile(path.join(models, fam.tokenizer, 'tokenizer.json')));
    for (const c of fam.cases) {
      if (c.rendered_prompt !== undefined) c.token_ids = (await tok.encode(c.rendered_prompt, null, { addSpecialTokens: false })).getIds();
    }
  }
  g.generator += ' + npm tokenizers 0.23.2';
  fs.writeFileSync(path.join(__dirname, 'family-chat-golden.json'), JSON.stringify(g, null, 1) + '\n');
  fs.unlinkSync(path.join(__dirname, 'family-chat-prompts.json'));
})();
