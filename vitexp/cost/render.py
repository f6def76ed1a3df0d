"""A table's cost as markdown (``results/tables/<table>.cost.md``, written by ``vitexp-tables``), and
the summary of every table in docs/cluster.md's generated section "What each table costs"."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from vitexp.cost.anchors import cost_config

#: The generated block of docs/cluster.md (between these lines; the rest of the page is hand-written).
BEGIN, END = "<!-- vitexp-tables: cost summary begin -->", "<!-- vitexp-tables: cost summary end -->"
#: The page the summary goes to when vitexp-tables writes the project's own tables.
DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"


def hours(h: float | None) -> str:
    if h is None:
        return "—"
    return f"{h:,.1f}" if h >= 1 else f"{h:.3f}"


def _relation(c: Mapping[str, Any]) -> str:
    a = c["anchor"]
    ratio = next(iter(a["flops_ratio"].values()), None)
    shown = f", FLOPs × {ratio:.2f}" if ratio is not None else ""
    if a["relation"] == "published":
        return f"`{a['name']}` published time ({a['gpu']}{shown} not applied)"
    if a["relation"] == "flops-only":
        return (
            f"**FLOPs-only** at `{a['name']}`'s FLOPs rate ({a['train_tflops']:.0f} TFLOP/s of training on"
            f" the {c['gpu']}){shown}"
        )
    return f"`{a['name']}` ({a['relation']}{shown})"


def _loader_cell(c: Mapping[str, Any]) -> str:
    """The loader's hours and the rate behind them: the training transform's, or for a row that only
    evaluates (a k-NN bank) the evaluation transform's."""
    rate = c["loader"]["train"] if c["stages"] else c["loader"]["eval"]
    if rate is None:
        return "not measured"
    return (
        f"{hours(c['loader_hours'])} ({c['workers']} ×"
        f" {rate.per_worker:.0f}/s{'' if c['stages'] else ', eval'})"
    )


def _range(cost: Mapping[str, Any]) -> str:
    """The total's range from the GPU factor's two ends (Lambda's resnet50 and bert_base_squad columns)."""
    if not cost.get("range_hours"):
        return ""
    low, high = cost["range_hours"]
    return (
        f" (range {hours(low)}–{hours(high)}: the GPU factor from Lambda's resnet50 or bert_base_squad"
        " column alone)"
    )


def _span(cost: Mapping[str, Any]) -> str:
    return (
        f"{hours(cost['range_hours'][0])}–{hours(cost['range_hours'][1])}" if cost.get("range_hours") else "—"
    )


def render_cost(cost: Mapping[str, Any]) -> str:
    """The cost as markdown: one line per row, the totals, and what each figure is anchored on."""
    gpu = cost["gpu"]
    lines = [
        f"# GPU cost of `{cost['table']}` ({gpu}-hours)",
        "",
        (
            f"| row | runs | {gpu}-hours per run | {gpu}-hours | bound | GPU time per run | loader time per"
            f" run (workers × images/s each) | workers to keep one GPU busy | anchor | stages ({gpu}-hours"
            " per run) | rehearsal |"
        ),
        "|---|---:|---:|---:|---|---:|---:|---:|---|---|---|",
    ]
    for r in cost["rows"]:
        c = r.get("cost")
        if c is None:
            lines.append(f"| {r['label']} | {r['runs']} | — | — | {r['missing']} | | | | | | |")
            continue
        stages = ", ".join(f"{k} {hours(v['hours'])}" for k, v in c["stages"].items()) or "evaluation only"
        basis = f"measured on {c['device'][5:]}" if c["basis"] == "measured" else _relation(c)
        lines.append(
            f"| {r['label']} | {r['runs']} | {hours(c['hours'])} | {hours(r['runs'] * c['hours'])} |"
            f" {c['bound']} | {hours(c['gpu_hours'])} | {_loader_cell(c)} | {c['workers_needed'] or '—'} |"
            f" {basis} | {stages}; eval {hours(c['eval']['hours'])} | `{c['rehearsal']}` |"
        )
    missing = f" ({len(cost['missing'])} row(s) without a cost left out)" if cost["missing"] else ""
    lines += [
        "",
        (
            f"**Total: {hours(cost['total_hours'])} {gpu}-hours**{missing}{_range(cost)}; "
            f"GPU time alone {hours(cost['total_gpu_hours'])}; at {cost['cpus']} CPU cores per GPU."
        ),
        "",
        *_notes(cost),
    ]
    return "\n".join(lines) + "\n"


def _notes(cost: Mapping[str, Any]) -> list[str]:
    gpu, factors = cost["gpu"], cost["factors"]
    costs = [r["cost"] for r in cost["rows"] if "cost" in r]
    anchors = sorted({(c["anchor"]["name"], c["anchor"]["source"]) for c in costs})
    rates = sorted(
        {
            (
                c["loader"][s].runs,
                s,
                c["loader"][s].per_worker,
                c["loader"][s].low,
                c["loader"][s].high,
                c["loader"][s].decoder,
                c["loader"][s].cpu,
            )
            for c in costs
            for s in ("train", "eval")
            if c["loader"][s] is not None
        }
    )
    out = [
        (
            "How: each phase (a training stage, the evaluation) costs the larger of its GPU time and its"
            " loader time. GPU time: images × the anchor's measured seconds per image × the row's FLOPs"
            " ratio to it (counted training step; the deployed model's forward for evaluation), moved from"
            f" the anchor's GPU to the {gpu} by the factor table. Loader time: images ÷ (images/s per worker"
            f" × the workers a task gets: min(data.num_workers, cpus_per_task {cost['cpus']} −"
            f" {cost['main_cores']})). vitexp/cost/, conf/cost.yaml."
        ),
        "",
        (
            f"- GPU factor {gpu}: {factors[gpu]['factor']:.2f} × RTX 3090 ({factors[gpu]['basis']}:"
            f" {factors[gpu]['source']})."
        ),
    ]
    for name, source in anchors:
        out.append(f"- Anchor `{name}`: {source}.")
    for runs, split, rate, low, high, decoder, cpu in rates:
        out.append(
            f"- Loader, {split} transform, {decoder}: {rate:.1f} images/s per worker, the median of"
            f" {len(runs)} run(s) ({low:.1f}–{high:.1f}; one core of {cpu}): "
            + ", ".join(f"`{r}`" for r in runs)
            + "."
        )
    unmeasured = cost.get("unmeasured_loader") or []
    if unmeasured:
        other = len([r for r in unmeasured if r in cost.get("no_decoder", [])])
        images = len(unmeasured) - other
        out.append(
            f"- Loader not measured for {len(unmeasured)} row(s), GPU time only: "
            + ", ".join(
                part
                for part in (
                    (
                        f"{images} on image folders whose transform no `vitexp-bench bench.mode=loader` has"
                        " timed"
                        if images
                        else ""
                    ),
                    (
                        f"{other} on data `bench.mode=loader` does not time (it times image folders only;"
                        " COCO decodes its JPEGs with PIL and builds masks, CIFAR-100 and Fashion-MNIST load"
                        " from memory): the CPU cores these rows need per GPU are not known"
                        if other
                        else ""
                    ),
                )
                if part
            )
            + "."
        )
    return out


def write_cost(cost: Mapping[str, Any], out_dir: Path) -> Path | None:
    """``<out_dir>/<table>.cost.md`` of a table's cost (:func:`vitexp.cost.rows.table_cost`) when any of its
    rows has one; its path, else ``None``."""
    from vitexp.ledger import atomic_write

    if not any("cost" in r for r in cost["rows"]):
        return None
    return atomic_write(Path(out_dir) / f"{cost['table']}.cost.md", render_cost(cost))


def _factor_table(factors: Mapping[str, Mapping[str, Any]]) -> list[str]:
    gpus = cost_config()["gpus"]
    ref = gpus["RTX 3090"]
    lines = [
        "| GPU | resnet50 / RTX 3090 | bert_base_squad / RTX 3090 | factor used | basis |",
        "|---|---:|---:|---:|---|",
    ]
    for name, f in factors.items():
        g = gpus.get(name)
        cols = (
            f"{g['resnet50'] / ref['resnet50']:.2f} | {g['bert_base_squad'] / ref['bert_base_squad']:.2f}"
            if g
            else "— | —"
        )
        basis = f"measured: {f['source']}" if f["basis"] == "measured" else f"Lambda's file, line {g['line']}"
        lines.append(f"| {name} | {cols} | {f['factor']:.2f} | {basis} |")
    return lines


def _loader_table(runs: Iterable[Mapping[str, Any]]) -> list[str]:
    from vitexp.cost.loader import decoder_verdicts

    lines = [
        (
            "| transform | runs | decoder | images/s per worker: median of each run (rounds of the newest) | "
            "wall-clock images/s per worker (newest) | faster beyond the spread between runs |"
        ),
        "|---|---:|---|---|---:|---|",
    ]
    runs = list(runs)
    newest = {r["run_id"]: r for r in runs}
    for key, v in decoder_verdicts(runs).items():
        split, img, aa, erase = key
        what = f"{split}, {img} px" + (f", {aa}" if aa else "") + (f", erasing {erase:g}" if erase else "")
        last = newest[v["runs"][-1]]
        m = last["metrics"]
        for d, medians in v["medians"].items():
            lines.append(
                f"| {what} | {len(v['runs'])} | {d} | {', '.join(f'{x:.1f}' for x in medians)} "
                f"({m[f'{d}_min']:.1f}–{m[f'{d}_max']:.1f}) | {m[f'{d}_wall_images_per_s_per_worker']:.1f} "
                f"| {v['winner'] or ('neither' if len(v['runs']) > 1 else 'one run: no verdict')} |"
            )
    lines.append("")
    lines.append("Runs: " + ", ".join(f"`{r['run_id']}`" for r in runs) + ".")
    return lines


def summary(costs: Iterable[Mapping[str, Any]], ledger=None) -> str:
    """The generated block of docs/cluster.md: the GPU factors, the loader measurements, the model against
    published training times, and per table its GPU-hours, GPU time alone, the CPU cores per GPU its rows
    need to keep the GPU busy and its loader-bound rows."""
    from vitexp.cost.anchors import gpu_factors
    from vitexp.cost.loader import loader_runs
    from vitexp.cost.validation import render as render_checks
    from vitexp.cost.validation import validations

    costs = [c for c in costs if any("cost" in r for r in c["rows"])]
    gpu = costs[0]["gpu"] if costs else cost_config()["target_gpu"]
    cpus = costs[0]["cpus"] if costs else None
    lines = [
        BEGIN,
        "",
        "GPU factors (training speed, RTX 3090 = 1):",
        "",
        *_factor_table(gpu_factors(ledger)),
        "",
        "Loaders measured (one worker; images per CPU-second of the worker, median and range of the rounds):",
        "",
        *_loader_table(loader_runs(ledger)),
        "",
        "The model against published training times:",
        "",
        render_checks(validations(ledger)).rstrip("\n"),
        "",
        f"Per table ({gpu}-hours; each phase the larger of GPU and loader time at {cpus} CPU cores per GPU):",
        "",
        (
            f"| table | {gpu}-hours | range (Lambda's two columns) | GPU time alone | CPU cores per GPU to"
            " keep it busy (most any row needs) | rows loader-bound | rows without a cost |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in costs:
        rows = [r for r in c["rows"] if "cost" in r]
        cores = str(c["cores_needed"]) if c["cores_needed"] else "not measured"
        lines.append(
            f"| [{c['table']}](../results/tables/{c['table']}.cost.md) | {hours(c['total_hours'])} "
            f"| {_span(c)} | {hours(c['total_gpu_hours'])} | {cores} | "
            f"{len(c['loader_bound'])} of {len(rows)} | {len(c['missing'])} |"
        )
    total = sum(c["total_hours"] for c in costs)
    low, high = (sum((c.get("range_hours") or (c["total_hours"],) * 2)[i] for c in costs) for i in (0, 1))
    lines += [
        "",
        (
            f"All tables: {hours(total)} {gpu}-hours, range {hours(low)}–{hours(high)} (vitexp-tables, from"
            " the ledger and conf/cost.yaml; each table's file names its anchors and loader measurements)."
        ),
        "",
        END,
    ]
    return "\n".join(lines) + "\n"


def write_summary(costs: Iterable[Mapping[str, Any]], page: Path = DOCS_PAGE, ledger=None) -> Path:
    """Replace the generated block of ``page`` (appended at its end the first time)."""
    from vitexp.ledger import atomic_write

    text = page.read_text()
    block = summary(costs, ledger)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block.rstrip("\n") + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    return atomic_write(page, text)


def target_gpu() -> str:
    return str(cost_config()["target_gpu"])
