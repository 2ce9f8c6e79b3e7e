//! Load balancing end to end: `bench --skew --record-load` writes the load, `eplb` balances
//! it, `demo` runs the placement and moves running ranks to it (threads and processes).

use std::path::PathBuf;
use std::process::{Command, Output};

fn moeflow(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeflow")).args(args).output().expect("the binary runs")
}

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("moeflow-balance-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn ok(args: &[&str]) -> String {
    let o = moeflow(args);
    assert!(o.status.success(), "{args:?}: {}", text(&o));
    text(&o)
}

/// The busiest rank's share over the mean from `bench`'s line on the routed slots each rank
/// served, checking that its shares add up to 100 %.
fn busiest(out: &str) -> f64 {
    let line = out.lines().find(|l| l.starts_with("routed slots each rank served")).expect("the ranks' shares");
    let (shares, rest) =
        line.split_once(": ").and_then(|(_, r)| r.split_once(" (the busiest ")).unwrap_or_else(|| panic!("{line}"));
    let total: f64 = shares.split(" / ").map(|s| s.trim_end_matches(" %").parse::<f64>().expect("a share")).sum();
    assert!((total - 100.0).abs() < 0.2, "{line}");
    rest.split_whitespace().next().and_then(|x| x.parse().ok()).expect("the busiest rank's ratio")
}

const SMALL: [&str; 4] = ["--preset", "olmoe-1b-7b", "--experts", "16"];

#[test]
fn recorded_skewed_load_is_balanced_and_moved_to() {
    let (load, placement) = (tmp("load.json"), tmp("placement.json"));
    let (l, p) = (load.to_str().unwrap(), placement.to_str().unwrap());
    let mut bench = vec!["bench", "--ep", "2", "--tokens", "32", "--min-runs", "2"];
    bench.extend(SMALL);
    bench.extend(["--min-seconds", "0", "--skew", "zipf:1.2", "--record-load", l]);
    let out = ok(&bench);
    assert!(out.contains("wrote the load statistics of 2 ranks"), "{out}");
    let skewed = busiest(&out);
    assert!(skewed > 1.05, "expert 0's rank serves more under zipf: {out}");
    let record: moeflow::LoadRecord = moeflow::LoadRecord::read(&load).unwrap();
    assert_eq!((record.num_experts, record.num_groups, record.ranks.len()), (16, 1, 2));
    // Expert 0 is the hottest under zipf.
    let totals = record.totals();
    assert_eq!(totals.iter().max(), totals.first());

    let out = ok(&["eplb", "--load", l, "--ep", "4", "--nodes", "2", "--redundant", "4", "-o", p]);
    let line = out.lines().find(|l| l.starts_with("busiest rank")).expect("a summary line");
    let nums: Vec<f64> =
        line.split(|c: char| !(c.is_ascii_digit() || c == '.')).filter_map(|w| w.parse().ok()).collect();
    assert!(nums[1] < nums[0], "the busiest rank's load drops: {line}");
    let placed = moeflow::placement::ExpertPlacement::from_json_file(&placement, 16, 4).unwrap();
    assert_eq!(placed.num_physical(), 20);

    // The EPLB speed check's sequence at EP 2 (docs/load-balancing.md): the bench runs the
    // placement, replicas included, with the skew it was computed for.
    let placement2 = tmp("placement2.json");
    let p2 = placement2.to_str().unwrap();
    ok(&["eplb", "--load", l, "--ep", "2", "--redundant", "4", "-o", p2]);
    let mut bench = vec!["bench", "--ep", "2", "--tokens", "16", "--min-runs", "1", "--min-seconds", "0"];
    bench.extend(SMALL);
    bench.extend(["--skew", "zipf:1.2", "--placement", p2]);
    let out = ok(&bench);
    assert!(out.contains(&format!("placement from {p2}")), "{out}");
    let balanced = busiest(&out);
    assert!(balanced < skewed, "the placement evens the ranks' shares: {balanced} against {skewed}");
    let row = out.lines().find(|l| l.split_whitespace().next() == Some("16")).expect("a row for 16 tokens");
    assert!(row.split_whitespace().nth(1).and_then(|ms| ms.parse::<f64>().ok()).is_some_and(|ms| ms > 0.0), "{row}");

    let mut demo = vec!["demo", "--ep", "4", "--tokens", "24", "--runs", "1"];
    demo.extend(SMALL);
    demo.extend(["--skew", "zipf:1.2"]);
    let out = ok(&[demo.as_slice(), &["--placement", p]].concat());
    assert!(out.contains("bit-for-bit identical") && out.contains("check           OK"), "{out}");
    let out = ok(&[demo.as_slice(), &["--rebalance", p]].concat());
    assert!(out.contains("rebalanced") && out.contains("identical before and after"), "{out}");
    let mut launched = vec!["launch", "--gpus", "4", "--"];
    launched.extend(&demo);
    let out = ok(&[launched.as_slice(), &["--rebalance", p]].concat());
    assert!(out.contains("identical before and after"), "{out}");

    let bad = moeflow(&["eplb", "--load", l, "--ep", "3", "--nodes", "2", "-o", p]);
    assert!(!bad.status.success() && text(&bad).contains("do not divide"), "{}", text(&bad));
    let bad = moeflow(&["demo", "--rebalance", p]);
    assert!(!bad.status.success() && text(&bad).contains("needs --ep > 1"), "{}", text(&bad));
    let bad = moeflow(&["demo", "--skew", "zipf:x"]);
    assert!(!bad.status.success() && text(&bad).contains("not a number"), "{}", text(&bad));
    for f in [load, placement, placement2] {
        std::fs::remove_file(f).ok();
    }
}

#[test]
fn simulate_predicts_from_built_in_and_calibrated_ceilings() {
    let svg = tmp("sim.svg");
    let s = svg.to_str().unwrap();
    let out = ok(&[
        "simulate",
        "--routing",
        "zipf:1.2",
        "--eplb",
        "16",
        "--ep",
        "1,2,8",
        "--tokens",
        "128,4096",
        "--plot",
        s,
    ]);
    assert!(out.contains("EPLB ms") && std::fs::read_to_string(&svg).unwrap().contains("<svg"), "{out}");
    let row = out.lines().find(|l| l.split_whitespace().take(2).eq(["8", "4096"])).expect("EP 8, 4096 tokens");
    assert!(row.contains('+') && !row.contains(" -"), "EPLB is faster at EP 8: {row}");

    let (ceilings, bench) = (tmp("ceilings.json"), tmp("bench.json"));
    let (c, b) = (ceilings.to_str().unwrap(), bench.to_str().unwrap());
    let small = ["--experts", "8", "--min-runs", "1", "--min-seconds", "0"];
    ok(&[&["bench", "--tokens", "16,32", "--calibrate", c][..], &small].concat());
    let parsed: moeflow::simulate::Ceilings =
        serde_json::from_str(&std::fs::read_to_string(&ceilings).unwrap()).unwrap();
    assert!(parsed.shared_device && parsed.gemm_curve.len() == 2 && parsed.link_curve.len() == 2, "{parsed:?}");
    ok(&[&["bench", "--tokens", "16", "--json", b][..], &small].concat());
    let out = ok(&[
        "simulate",
        "--ceilings",
        c,
        "--preset",
        "olmoe-1b-7b",
        "--experts",
        "8",
        "--ep",
        "1",
        "--tokens",
        "16",
        "--compare",
        b,
    ]);
    assert!(out.contains("largest error against the measured rows"), "{out}");

    let bad = moeflow(&["simulate", "--routing", "gauss"]);
    assert!(!bad.status.success() && text(&bad).contains("uniform, zipf:S or load:FILE"), "{}", text(&bad));
    let bad = moeflow(&["bench", "--ep", "2", "--calibrate", c]);
    assert!(!bad.status.success() && text(&bad).contains("one rank"), "{}", text(&bad));
    for f in [svg, ceilings, bench] {
        std::fs::remove_file(f).ok();
    }
}
