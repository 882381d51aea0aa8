#!/usr/bin/env bash
# Regenerate the reference voice clips for voice-clone benchmarks, and voices.jsonl describing them.
# Why synthetic: espeak-ng speech is ours to redistribute (no speaker consent or licence questions), and
# it exists on any Debian machine. The committed WAVs are the reference: other espeak-ng/sox versions
# produce slightly different audio, so only regenerate on purpose.
#   Needs: espeak-ng, sox (Debian: apt-get install espeak-ng sox), python3.
#   Usage: bash datasets/voices/make_voices.sh   (writes next to this script)
set -euo pipefail
cd "$(dirname "$0")"
command -v espeak-ng >/dev/null && command -v sox >/dev/null || {
  echo "make_voices.sh: needs espeak-ng and sox (apt-get install espeak-ng sox)" >&2; exit 1; }

jsonl=voices.jsonl.tmp
: > "$jsonl"

# voice NAME LANGUAGE ESPEAK_VOICE TEXT
# Each clip: espeak-ng at 170 words/min -> sox: 24 kHz mono 16-bit PCM, no dither (reproducible),
# peak-normalised to -3 dBFS, 0.1 s silence before and 0.2 s after. TEXT is also the clip's ref_text.
voice() {
  local name=$1 language=$2 espeak_voice=$3 text=$4
  case "$text" in *'"'*|*'$'*|*'`'*|*'\'*)
    echo "make_voices.sh: text of $name must not contain \" \$ \` or \\" >&2; exit 1 ;;
  esac
  local cmd="espeak-ng -v $espeak_voice -s 170 --stdout \"$text\" | sox -V1 -D -t wav - -r 24000 -c 1 -b 16 $name.wav gain -n -3 pad 0.1 0.2"
  bash -o pipefail -c "$cmd"
  python3 - "$name" "$language" "$text" "$cmd" >> "$jsonl" <<'PY'
import json, sys
name, language, text, cmd = sys.argv[1:]
print(json.dumps({"name": name, "file": f"{name}.wav", "ref_text": text, "language": language,
                  "command": cmd}, ensure_ascii=False))
PY
  echo "made $name.wav ($(soxi -D "$name.wav") s)"
}

voice en_us_male   English en-us+m3 "The library opens at nine, and the reading room stays quiet until noon."
voice en_us_female English en-us+f3 "Could you send me the photos from the trip when you have a spare minute?"
voice en_gb_male   English en-gb-x-rp+m1 "Heavy rain is expected in the north tonight, clearing by morning."
voice en_gb_female English en-gb+f4 "Turn left at the old bridge, then follow the river path to the market."
voice de_male      German  de+m2 "Der Zug nach Hamburg fährt heute von Gleis sieben ab."
voice fr_female    French  fr-fr+f2 "Nous avons réservé une table près de la fenêtre pour huit heures ce soir."
voice es_male      Spanish es+m4 "Mañana por la tarde vamos a visitar a mis abuelos en el pueblo."
voice it_female    Italian it+f5 "Il museo resta chiuso il lunedì, ma domenica l'ingresso è gratuito."

mv "$jsonl" voices.jsonl
