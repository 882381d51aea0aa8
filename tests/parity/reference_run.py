"""Run the official qwen-tts (in .venv-ref) on a checkpoint and save what it produced, for the parity tests.

    .venv-ref/bin/python tests/parity/reference_run.py SPEC.json OUT_DIR

SPEC: {"checkpoint": dir, "jobs": {name: job}}: the checkpoint is loaded once and every job writes
OUT_DIR/<name>.npz. A job: {"task": "custom_voice"|"voice_design"|"voice_clone", "text": str,
"language": str, "speaker": str, "instruct": str, "ref_audio": wav path, "ref_text": str, "x_vector_only": bool,
"non_streaming_mode": bool|null, "generate": {generation kwargs}, "seed": int}.
npz: codes [T, 16] (the generated frames), wav (float32, 24 kHz), sample_rate; for voice clone also
ref_code [T_ref, 16] and spk_embedding [H] as the reference computed them from ref_audio.

It goes through the public wrapper (Qwen3TTSModel.generate_*), so tokenization, prompt building, decoding and
the ICL waveform cut are the official ones; the model's generate is wrapped only to record the codes.
Runs on CPU in fp32 with SDPA attention. Imports nothing from this repository.
"""

import json
import sys

import numpy as np
import soundfile as sf
import torch


def main(spec_path: str, out_dir: str) -> None:
    from qwen_tts import Qwen3TTSModel

    spec = json.load(open(spec_path, encoding="utf-8"))
    tts = Qwen3TTSModel.from_pretrained(spec["checkpoint"], dtype=torch.float32, device_map="cpu",
                                        attn_implementation="sdpa")
    for name, job in spec["jobs"].items():
        run_job(tts, job, f"{out_dir}/{name}.npz")


def run_job(tts, spec: dict, out_path: str) -> None:
    torch.manual_seed(spec.get("seed", 0))
    recorded = {}
    original_generate = type(tts.model).generate.__get__(tts.model)

    def recording_generate(*args, **kwargs):
        codes_list, hiddens = original_generate(*args, **kwargs)
        recorded["codes"] = codes_list[0].cpu().numpy()
        return codes_list, hiddens

    tts.model.generate = recording_generate
    gen = dict(spec.get("generate", {}))
    if spec.get("non_streaming_mode") is not None:
        gen["non_streaming_mode"] = spec["non_streaming_mode"]
    task = spec["task"]
    extra = {}
    if task == "custom_voice":
        wavs, sr = tts.generate_custom_voice(text=spec["text"], speaker=spec["speaker"], language=spec["language"],
                                             instruct=spec.get("instruct"), **gen)
    elif task == "voice_design":
        wavs, sr = tts.generate_voice_design(text=spec["text"], instruct=spec.get("instruct", ""),
                                             language=spec["language"], **gen)
    elif task == "voice_clone":
        audio, audio_sr = sf.read(spec["ref_audio"], dtype="float32")
        items = tts.create_voice_clone_prompt(ref_audio=(audio, audio_sr), ref_text=spec.get("ref_text"),
                                              x_vector_only_mode=spec.get("x_vector_only", False))
        wavs, sr = tts.generate_voice_clone(text=spec["text"], language=spec["language"], voice_clone_prompt=items,
                                            **gen)
        extra["spk_embedding"] = items[0].ref_spk_embedding.float().cpu().numpy()
        if items[0].ref_code is not None:
            extra["ref_code"] = items[0].ref_code.cpu().numpy()
    else:
        raise SystemExit(f"unknown task {task!r}")
    np.savez(out_path, codes=recorded["codes"], wav=np.asarray(wavs[0], dtype=np.float32), sample_rate=sr, **extra)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
