//! Table tests: every branch of [`plan`], [`wants_pairing`] and the failover policy.

use std::time::Duration;

use super::*;

fn t(hp: &str) -> Target {
    Target::parse(hp, "http", None).unwrap()
}

fn with_id(hp: &str, id: &str) -> Target {
    Target { id: Some(id.into()), ..t(hp) }
}

fn inputs() -> Inputs {
    Inputs {
        redirected: None,
        header: Vec::new(),
        prompt_tokens: Some(100),
        local_below_tokens: 0,
        pairing: PairingAnswer::NotAsked,
        view: vec![with_id("v:1", "view-0")],
        statics: vec![t("s:1"), t("s:2")],
        dead: Vec::new(),
        local: LocalEngine::ComputesPrompts,
    }
}

fn prefills(list: &[&str]) -> Plan {
    Plan::Prefill(list.iter().map(|hp| t(hp)).collect())
}

/// Compares plans by base URL (ids are the inputs' business).
fn bases(plan: &Plan) -> Plan {
    match plan {
        Plan::Prefill(list) => Plan::Prefill(list.iter().map(|x| t(&x.base)).collect()),
        other => other.clone(),
    }
}

fn decided(prefill: Option<&str>, remote: Option<(&str, Option<&str>)>) -> PairingAnswer {
    PairingAnswer::Decided(Box::new(Pairing {
        prefill: prefill.map(|hp| with_id(hp, "paired")),
        remote_decode: remote.map(|(id, sidecar)| RemoteDecode { id: id.into(), sidecar: sidecar.map(t) }),
        decode_rank: None,
    }))
}

#[test]
fn plan_table() {
    type Edit = fn(&mut Inputs);
    let here = |p: Plan| Route::Here(p);
    let cases: Vec<(&str, Edit, Route)> = vec![
        ("static list, round robin order kept", |_| {}, here(prefills(&["s:1", "s:2"]))),
        ("nothing configured", |i| i.statics.clear(), here(Plan::Local(LocalReason::NoCandidate))),
        (
            "short prompt",
            |i| {
                i.local_below_tokens = 101;
                i.header = vec![t("h:1")]
            },
            here(Plan::Local(LocalReason::Threshold)),
        ),
        ("prompt at the threshold disaggregates", |i| i.local_below_tokens = 100, here(prefills(&["s:1", "s:2"]))),
        (
            "no estimate: never short",
            |i| {
                i.local_below_tokens = 1000;
                i.prompt_tokens = None
            },
            here(prefills(&["s:1", "s:2"])),
        ),
        (
            "header first, then the statics",
            |i| i.header = vec![t("h:1"), t("s:2")],
            here(prefills(&["h:1", "s:2", "s:1"])),
        ),
        (
            "redirected local",
            |i| {
                i.redirected = Some(Redirected::Local);
                i.header = vec![t("h:1")]
            },
            here(Plan::Local(LocalReason::Coordinator)),
        ),
        (
            "redirected prefill: header, view, statics",
            |i| {
                i.redirected = Some(Redirected::Prefill);
                i.header = vec![t("h:1")]
            },
            here(prefills(&["h:1", "v:1", "s:1", "s:2"])),
        ),
        (
            "redirected, header refused: view, statics",
            |i| i.redirected = Some(Redirected::Prefill),
            here(prefills(&["v:1", "s:1", "s:2"])),
        ),
        (
            "pairing unavailable: view, statics",
            |i| i.pairing = PairingAnswer::Unavailable,
            here(prefills(&["v:1", "s:1", "s:2"])),
        ),
        (
            "paired prefill, then statics (no view)",
            |i| i.pairing = decided(Some("p:1"), None),
            here(prefills(&["p:1", "s:1", "s:2"])),
        ),
        ("paired local_prefill", |i| i.pairing = decided(None, None), here(Plan::Local(LocalReason::Coordinator))),
        (
            "dead engines are skipped",
            |i| {
                i.pairing = decided(Some("p:1"), None);
                i.dead = vec!["paired".into(), "http://s:1".into()]
            },
            here(prefills(&["s:2"])),
        ),
        (
            "all dead",
            |i| i.dead = vec!["http://s:1".into(), "http://s:2".into()],
            here(Plan::Local(LocalReason::NoCandidate)),
        ),
        (
            "paired with another decode without sidecar",
            |i| i.pairing = decided(Some("p:1"), Some(("d1", None))),
            Route::NoSidecar { decode: "d1".into(), plan: prefills(&["p:1", "v:1", "s:1", "s:2"]) },
        ),
        (
            "another decode, local_prefill, no sidecar: never the whole prompt here",
            |i| {
                i.pairing = decided(None, Some(("d1", None)));
                i.view.clear();
                i.statics.clear()
            },
            Route::NoSidecar { decode: "d1".into(), plan: Plan::Local(LocalReason::NoCandidate) },
        ),
    ];
    for (name, edit, want) in cases {
        let mut i = inputs();
        edit(&mut i);
        let got = match plan(&i) {
            Route::Here(p) => Route::Here(bases(&p)),
            Route::NoSidecar { decode, plan } => Route::NoSidecar { decode, plan: bases(&plan) },
            other => other,
        };
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn redirect_carries_its_fallback() {
    let mut i = inputs();
    i.pairing = decided(Some("p:1"), Some(("d1", Some("d:8000"))));
    let Route::Redirect(r) = plan(&i) else { panic!("{:?}", plan(&i)) };
    assert_eq!((r.decode.as_str(), r.sidecar.base.as_str()), ("d1", "http://d:8000"));
    assert_eq!(r.prefill.as_ref().map(|p| p.base.as_str()), Some("http://p:1"));
    assert_eq!(bases(&r.fallback), prefills(&["p:1", "v:1", "s:1", "s:2"]));
    i.pairing = decided(None, Some(("d1", Some("d:8000"))));
    let Route::Redirect(r) = plan(&i) else { panic!() };
    assert_eq!((r.prefill, bases(&r.fallback)), (None, prefills(&["v:1", "s:1", "s:2"])));
}

#[test]
fn pairing_is_asked_only_when_nothing_decided_already() {
    type Edit = fn(&mut Inputs);
    let cases: [(&str, Edit, bool); 5] = [
        ("plain request", |_| {}, true),
        ("routing header", |i| i.header = vec![t("h:1")], false),
        ("redirected prefill", |i| i.redirected = Some(Redirected::Prefill), false),
        ("redirected local", |i| i.redirected = Some(Redirected::Local), false),
        ("short prompt", |i| i.local_below_tokens = 1000, false),
    ];
    for (name, edit, want) in cases {
        let mut i = inputs();
        edit(&mut i);
        assert_eq!(wants_pairing(&i), want, "{name}");
    }
}

const POLICY: Failover = Failover {
    max_attempts: 3,
    backoff: Duration::from_millis(20),
    backoff_max: Duration::from_millis(50),
    fallback: Fallback::Fail,
};

#[test]
fn backoff_doubles_caps_and_jitters() {
    let ms = |n, jitter| POLICY.backoff(n, jitter).as_secs_f64() * 1e3;
    let cases = [(1, 1.0, 20.0), (1, 0.0, 10.0), (2, 1.0, 40.0), (3, 1.0, 50.0), (40, 0.5, 37.5), (2, 7.0, 40.0)];
    for (n, jitter, want) in cases {
        assert!((ms(n, jitter) - want).abs() < 1e-6, "failover {n}, jitter {jitter}: {}", ms(n, jitter));
    }
}

/// A readable form of a [`Next`] for the tables.
fn describe(next: &Next<'_>) -> String {
    match next {
        Next::Retry { target, after } => format!("retry {} after {}ms", target.base, after.as_millis()),
        Next::Fallback(e) => format!("fallback ({e})"),
        Next::Fail(e) => format!("fail ({e})"),
    }
}

#[test]
fn failover_table() {
    let local = Failover { fallback: Fallback::Local, ..POLICY };
    let u = || AttemptFailure::Unreachable("refused".into());
    let f = || AttemptFailure::Failed("timed out".into());
    let cases = [
        ("first failure: the next candidate", POLICY, 4, vec![f()], "retry http://b:1 after 20ms"),
        ("second failure waits longer", POLICY, 4, vec![u(), f()], "retry http://c:1 after 40ms"),
        ("attempts capped by the policy", POLICY, 4, vec![f(), u(), u()], "fail (prefill failed (3 tried): refused)"),
        ("capped by the candidates", POLICY, 1, vec![f()], "fail (prefill failed (1 tried): timed out)"),
        (
            "every candidate unreachable: 503",
            POLICY,
            2,
            vec![u(), u()],
            "fail (no prefill engine available (2 tried): refused)",
        ),
        ("fallback local", local, 2, vec![u(), f()], "fallback (prefill failed (2 tried): timed out)"),
        (
            "fallback local, unreachable",
            local,
            1,
            vec![u()],
            "fallback (no prefill engine available (1 tried): refused)",
        ),
    ];
    let candidates = [t("a:1"), t("b:1"), t("c:1"), t("d:1")];
    for (name, policy, n, failures, want) in cases {
        let mut attempts = Attempts::default();
        let got: Vec<String> = failures
            .iter()
            .map(|failure| describe(&policy.next(&candidates[..n], &mut attempts, failure, 1.0)))
            .collect();
        assert_eq!(got.last().map(String::as_str), Some(want), "{name}: {got:?}");
        assert_eq!(attempts.made, failures.len(), "{name}");
    }
    assert_eq!(
        POLICY.give_up(&Attempts::default(), "none"),
        Next::Fail(PrefillExhausted::NothingReachable { tried: 0, last: "none".into() })
    );
}

/// A decode-only local engine (a decode-mode SGLang): every local decision becomes a prefill leg
/// over the prefills known (header, view, static list, the dead left out), or an error when
/// there are none; other decisions are kept; `--fallback local` becomes a failure.
#[test]
fn a_decode_only_engine_never_gets_a_request_without_a_prefill_leg() {
    type Edit = fn(&mut Inputs);
    let here = |p: Plan| Route::Here(p);
    let cases: Vec<(&str, Edit, Route)> = vec![
        (
            "short prompt: the header first",
            |i| {
                i.local_below_tokens = 101;
                i.header = vec![t("h:1")];
            },
            here(prefills(&["h:1", "v:1", "s:1", "s:2"])),
        ),
        (
            "redirected with the local mark",
            |i| i.redirected = Some(Redirected::Local),
            here(prefills(&["v:1", "s:1", "s:2"])),
        ),
        (
            "the coordinator's local_prefill",
            |i| i.pairing = decided(None, None),
            here(prefills(&["v:1", "s:1", "s:2"])),
        ),
        (
            "the dead left out",
            |i| {
                i.redirected = Some(Redirected::Local);
                i.dead = vec!["view-0".into(), "http://s:1".into()];
            },
            here(prefills(&["s:2"])),
        ),
        (
            "no prefill known",
            |i| {
                i.local_below_tokens = 101;
                i.view.clear();
                i.statics.clear();
            },
            here(Plan::NoPrefillForDecodeOnly(LocalReason::Threshold)),
        ),
        (
            "nothing configured",
            |i| {
                i.view.clear();
                i.statics.clear();
            },
            here(Plan::NoPrefillForDecodeOnly(LocalReason::NoCandidate)),
        ),
        (
            "a prefill decision is kept",
            |i| i.pairing = decided(Some("p:1"), None),
            here(prefills(&["p:1", "s:1", "s:2"])),
        ),
    ];
    for (name, edit, want) in cases {
        let mut i = inputs();
        i.local = LocalEngine::DecodeOnly;
        edit(&mut i);
        let got = match plan(&i) {
            Route::Here(p) => Route::Here(bases(&p)),
            other => other,
        };
        assert_eq!(got, want, "{name}");
        // The same inputs for an engine that computes prompts: only the engine kind differs.
        i.local = LocalEngine::ComputesPrompts;
        if matches!(want, Route::Here(Plan::NoPrefillForDecodeOnly(_))) {
            assert!(matches!(plan(&i), Route::Here(Plan::Local(_))), "{name}");
        }
    }
    // A redirect's fallback (serving here after all) needs a prefill too.
    let mut i = inputs();
    i.local = LocalEngine::DecodeOnly;
    i.pairing = decided(None, Some(("d2", None)));
    i.view.clear();
    i.statics.clear();
    assert_eq!(
        plan(&i),
        Route::NoSidecar { decode: "d2".into(), plan: Plan::NoPrefillForDecodeOnly(LocalReason::NoCandidate) }
    );
    // --fallback local cannot compute the prompt here: the leg fails instead.
    let local = Failover { fallback: Fallback::Local, ..POLICY };
    assert_eq!(local.for_engine(LocalEngine::ComputesPrompts), local);
    assert_eq!(local.for_engine(LocalEngine::DecodeOnly).fallback, Fallback::Fail);
    let mut attempts = Attempts::default();
    let only = [t("a:1")];
    let next = local.for_engine(LocalEngine::DecodeOnly).next(
        &only,
        &mut attempts,
        &AttemptFailure::Unreachable("refused".into()),
        1.0,
    );
    assert_eq!(next, Next::Fail(PrefillExhausted::NothingReachable { tried: 1, last: "refused".into() }));
}
