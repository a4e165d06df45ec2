//! The shared runner driven by a fake executor (no GPU, no processes): the interleaved order,
//! `--runs` merging, unsupported rows, per-run case preparation and the common notes.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;

use super::protocol::{CaseFiles, CheckSpec, OutputSpec, Reply};
use super::*;
use crate::schema::{MachineState, Param, Reference};

struct FakeSuite {
    prepared: RefCell<Vec<i64>>,
}

fn t(case: &Params) -> i64 {
    match case["seq_len"] {
        Param::Int(t) => t,
        _ => unreachable!(),
    }
}

impl Suite for FakeSuite {
    fn suite(&self) -> schema::Suite {
        schema::Suite::Attention
    }
    fn prepare(&self, case: &Params, _seed: u64, dir: &Path) -> Result<CaseFiles> {
        self.prepared.borrow_mut().push(t(case));
        Ok(CaseFiles {
            inputs: vec![],
            output: OutputSpec {
                dtype: "bf16".into(),
                shape: vec![1],
            },
            check: CheckSpec {
                ranges: vec![],
                reference: dir.join("ref.f64"),
                reference_kind: Reference::Float64Cpu,
                tolerance: 1e-2,
                checked: "all".into(),
            },
            gradients: vec![],
            arguments: Default::default(),
            flops: Some(1e9),
            bytes: None,
            items: None,
        })
    }
    fn unsupported(&self, case: &Params, imp: &str) -> Option<String> {
        (imp == "math" && t(case) > 1000).then(|| "too long for math".to_string())
    }
    fn is_default(&self, _case: &Params, imp: &str) -> bool {
        imp == "flash"
    }
    /// A case of another op (`op = layer`) is flash's alone.
    fn applies(&self, case: &Params, imp: &str) -> bool {
        !matches!(case.get("op"), Some(Param::Text(op)) if op == "layer") || imp == "flash"
    }
    /// Configurations of one shape share their inputs, as in a tile sweep.
    fn inputs_key(&self, case: &Params) -> Params {
        let mut key = case.clone();
        key.remove("config");
        key
    }
    fn notes(&self, _case: &Params, imp: &str) -> Vec<String> {
        if imp == "torch_math" {
            vec!["float32 accumulation".into()]
        } else {
            vec![]
        }
    }
}

/// Records every job; the time of a row is its seq_len ÷ 1000 ms, plus the run index ÷ 10
/// (so runs differ), and torch rows are host-bound at 512.
struct FakeExec {
    order: Vec<(String, i64)>,
    run: RefCell<u32>,
}

impl Executor for FakeExec {
    fn measure(&mut self, imp: &Implementation, job: &Job) -> Reply {
        let t = t(&job.case);
        self.order.push((imp.name.clone(), t));
        let r = self.order.len() as f64;
        *self.run.borrow_mut() += 1;
        let median = t as f64 / 1000.0 + (r % 3.0) / 10.0;
        let mut row = Row::failed(
            job.case.clone(),
            "ignored",
            "ignored",
            false,
            Status::Ok,
            "",
        );
        row.message = None;
        row.median_ms = Some(median);
        row.q1_ms = Some(median * 0.99);
        row.q3_ms = Some(median * 1.01);
        row.flops = job.files.flops;
        row.host_ms = Some(if imp.name.starts_with("torch") && t == 512 {
            median
        } else {
            0.001
        });
        row.input_sets = Some(64);
        row.l2_rotation_reached = Some(if t == 512 { 1.5 } else { 3.0 });
        Reply {
            row,
            window: Some([1.0, 2.0]),
            libraries: BTreeMap::from([("torch".to_string(), "9.9".to_string())]),
            pid: None,
        }
    }
}

struct FakeSink {
    saved: usize,
    rows_seen: Vec<usize>,
}

impl Sink for FakeSink {
    fn start(&mut self, _run: u32, _case: &Params, _imp: &Implementation) {}
    fn row(&mut self, _reply: &Reply, rows: &[Row]) -> Result<()> {
        self.saved += 1;
        self.rows_seen.push(rows.len());
        Ok(())
    }
    fn machine(&mut self, _window: [f64; 2]) -> Option<MachineState> {
        Some(MachineState {
            sm_clock_mhz: Some(1980.0),
            ..Default::default()
        })
    }
    fn machine_note(&self) -> Option<String> {
        None
    }
}

fn cases() -> Vec<Params> {
    [512, 2048]
        .into_iter()
        .map(|t| Params::from([("seq_len".to_string(), Param::Int(t))]))
        .collect()
}

fn imps() -> Vec<Implementation> {
    implementations(
        &[("flash", "kernelpages"), ("math", "kernelpages")],
        &[Alternative {
            name: "torch",
            module: "torch_sdpa",
            library: "PyTorch",
            implementations: &["torch_cudnn", "torch_math"],
        }],
        &["torch".to_string()],
    )
    .unwrap()
}

fn run_fake(runs: u32) -> (Vec<Row>, FakeExec, FakeSink, Vec<i64>) {
    run_fake_on(runs, cases())
}

fn run_fake_on(runs: u32, cases: Vec<Params>) -> (Vec<Row>, FakeExec, FakeSink, Vec<i64>) {
    let suite = FakeSuite {
        prepared: RefCell::new(vec![]),
    };
    let timing = TimingConfig {
        runs,
        ..default_timing()
    };
    let dir = tempfile::tempdir().unwrap();
    let imps = imps();
    let g = Grid {
        suite: &suite,
        cases: &cases,
        implementations: &imps,
        timing: &timing,
        seed: 1,
        device: DeviceChoice::Gpu,
        l2_bytes: 60_000_000,
        cache: "L2",
        scratch: dir.path(),
    };
    let mut exec = FakeExec {
        order: vec![],
        run: RefCell::new(0),
    };
    let mut sink = FakeSink {
        saved: 0,
        rows_seen: vec![],
    };
    let rows = measure_grid(&g, &mut exec, &mut sink).unwrap();
    let prepared = suite.prepared.borrow().clone();
    (rows, exec, sink, prepared)
}

#[test]
fn implementations_of_one_case_run_back_to_back() {
    let (rows, exec, sink, prepared) = run_fake(1);
    let order: Vec<(&str, i64)> = exec.order.iter().map(|(n, t)| (n.as_str(), *t)).collect();
    // math is unsupported at 2048: no process, but still a row.
    assert_eq!(
        order,
        vec![
            ("flash", 512),
            ("math", 512),
            ("torch_cudnn", 512),
            ("torch_math", 512),
            ("flash", 2048),
            ("torch_cudnn", 2048),
            ("torch_math", 2048),
        ]
    );
    assert_eq!(prepared, vec![512, 2048], "each case prepared once");
    assert_eq!(rows.len(), 8);
    assert_eq!(sink.saved, 8, "the document is saved after every row");
    assert_eq!(sink.rows_seen, (1..=8).collect::<Vec<_>>());
    let math = &rows[5];
    assert_eq!(
        (math.implementation.as_str(), math.status),
        ("math", Status::Unsupported)
    );
    assert!(rows[0].default && !rows[2].default);
    assert_eq!(rows[2].library, "PyTorch");
    assert_eq!(rows[0].machine.as_ref().unwrap().sm_clock_mhz, Some(1980.0));
}

#[test]
fn pairs_that_do_not_apply_have_no_row_and_no_process() {
    let mut cs = cases();
    cs.push(Params::from([
        ("seq_len".to_string(), Param::Int(64)),
        ("op".to_string(), Param::Text("layer".into())),
    ]));
    let (rows, exec, sink, _) = run_fake_on(1, cs.clone());
    assert_eq!(exec.order.last().unwrap(), &("flash".to_string(), 64));
    // 8 rows of the two cases, one of the layer case (unsupported pairs do have rows).
    assert_eq!(rows.len(), 9);
    assert_eq!(sink.saved, 9);
    assert_eq!(rows[8].implementation, "flash");
    let suite = FakeSuite {
        prepared: RefCell::new(vec![]),
    };
    assert_eq!(applicable(&suite, &cs, &imps(), 2).len(), 2 * 9);
}

#[test]
fn cases_with_one_inputs_key_are_prepared_once_and_keep_their_own_parameters() {
    let with_config = |t: i64, c: &str| {
        Params::from([
            ("seq_len".to_string(), Param::Int(t)),
            ("config".to_string(), Param::Text(c.into())),
        ])
    };
    let cases = vec![
        with_config(512, "a"),
        with_config(512, "b"),
        with_config(2048, "a"),
        with_config(512, "c"),
    ];
    let (rows, exec, _, prepared) = run_fake_on(1, cases.clone());
    // 512 a and b share one preparation; 2048 needs its own; 512 c follows 2048, so the
    // folder of 512 is gone and it is prepared again.
    assert_eq!(prepared, vec![512, 2048, 512]);
    // Every (case, implementation) but math at 2048 (unsupported, never started) ran.
    assert_eq!(exec.order.len(), cases.len() * imps().len() - 1);
    for (i, case) in cases.iter().enumerate() {
        for (j, imp) in imps().iter().enumerate() {
            let row = &rows[i * imps().len() + j];
            assert_eq!(&row.case, case, "a row keeps its own configuration");
            assert_eq!(row.implementation, imp.name);
        }
    }
}

#[test]
fn runs_repeat_the_grid_and_keep_every_median() {
    let (rows, exec, _, prepared) = run_fake(3);
    assert_eq!(exec.order.len(), 3 * 7);
    // The second run starts after the whole first run.
    assert_eq!(exec.order[7], ("flash".to_string(), 512));
    assert_eq!(prepared, vec![512, 2048, 512, 2048, 512, 2048]);
    assert_eq!(rows.len(), 8);
    let flash = &rows[0];
    assert_eq!(flash.runs_ms.len(), 3);
    let mut sorted = flash.runs_ms.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    assert_eq!(flash.median_ms, Some(sorted[1]), "the median run is kept");
    assert!(rows[5].runs_ms.is_empty(), "unsupported rows have no runs");
}

#[test]
fn common_notes_flag_capped_rotation_and_launch_bound_rows() {
    let (rows, _, _, _) = run_fake(1);
    let cudnn512 = &rows[2];
    assert!(cudnn512.launch_bound(LAUNCH_BOUND));
    assert!(
        cudnn512.notes.iter().any(|n| n.starts_with("launch-bound")),
        "{:?}",
        cudnn512.notes
    );
    assert!(cudnn512
        .notes
        .iter()
        .any(|n| n.contains("capped at 64 input sets")));
    let torch_math = &rows[3];
    assert!(torch_math
        .notes
        .contains(&"float32 accumulation".to_string()));
    let flash2048 = &rows[4];
    assert!(flash2048.notes.is_empty(), "{:?}", flash2048.notes);
}

const LAUNCH_BOUND: f64 = crate::schema::LAUNCH_BOUND_RATIO;

#[test]
fn merge_of_failed_runs_notes_them() {
    let case = cases()[0].clone();
    let mut ok = Row::failed(case.clone(), "flash", "k", true, Status::Ok, "");
    ok.median_ms = Some(1.0);
    let bad = Row::failed(case, "flash", "k", true, Status::Timeout, "slow");
    let m = merge_runs(&[bad.clone(), ok.clone()]);
    assert_eq!(m.status, Status::Ok);
    assert_eq!(m.runs_ms, vec![1.0]);
    assert!(m.notes[0].starts_with("run 1 of 2: timeout"));
    assert_eq!(
        merge_runs(&[bad.clone(), bad.clone()]).status,
        Status::Timeout
    );
    assert_eq!(merge_runs(std::slice::from_ref(&ok)), ok);
}

#[test]
fn unknown_alternative_is_an_error() {
    let e = implementations(&[], &[], &["jax".into()]).unwrap_err();
    assert!(e.to_string().contains("jax"));
}

#[test]
fn selection_applies_quick_filter_and_shard() {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: RunnerArgs,
    }
    let grid = grid::expand(
        &[("seq_len", [512, 1024, 2048, 4096].map(Param::Int).to_vec())],
        &Params::new(),
    );
    let quick = grid[..2].to_vec();
    let cli = Cli::try_parse_from(["x", "--filter", "seq_len>=1024", "--shard", "1/2"]).unwrap();
    let kept = cli.args.select(grid.clone(), quick.clone()).unwrap();
    assert_eq!(kept.iter().map(t).collect::<Vec<_>>(), vec![1024, 4096]);
    let cli = Cli::try_parse_from(["x", "--quick"]).unwrap();
    assert_eq!(cli.args.select(grid.clone(), quick.clone()).unwrap(), quick);
    let cli = Cli::try_parse_from(["x", "--filter", "seqlen=4"]).unwrap();
    assert!(cli.args.select(grid.clone(), quick.clone()).is_err());
    // A value the grid never takes selects nothing: an error naming the filter, not an empty
    // document.
    let cli = Cli::try_parse_from(["x", "--filter", "seq_len>=99999"]).unwrap();
    let e = cli
        .args
        .select(grid.clone(), quick)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no case") && e.contains("seq_len>=99999") && e.contains("4 cases"),
        "{e}"
    );
    assert!(Cli::try_parse_from(["x", "--runs", "0"]).is_err());
    let cli = Cli::try_parse_from(["x", "--runs", "3", "--warmup-ms", "50"]).unwrap();
    let timing = cli.args.timing();
    assert_eq!((timing.runs, timing.warmup_ms), (3, 50.0));
}

#[test]
fn every_run_gets_a_new_empty_scratch_folder() {
    let a = fresh_scratch("test-scratch").unwrap();
    let b = fresh_scratch("test-scratch").unwrap();
    assert_ne!(a, b, "a folder that already exists is never reused");
    for d in [&a, &b] {
        assert!(d.is_dir() && std::fs::read_dir(d).unwrap().next().is_none());
        std::fs::remove_dir(d).unwrap();
    }
}
