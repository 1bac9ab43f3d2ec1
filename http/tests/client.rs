//! The upstream client against scripted HTTP/1.1 servers on loopback sockets: framing, reuse of
//! kept connections, stale connections, broken answers and bounds.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use pd_http::client::{framing::FramingError, Client, ClientConfig, ClientError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn client(idle_timeout: Duration) -> Client {
    let roots = rustls::RootCertStore::empty();
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Client::new(ClientConfig {
        connect_timeout: Duration::from_secs(2),
        tcp_keepalive: Some(Duration::from_secs(30)),
        idle_timeout,
        max_idle_per_origin: 16,
        tls: Arc::new(tls),
    })
}

/// What a scripted server does with one request: the request's head and body in, the bytes to
/// answer with (each written apart, 5 ms between) and whether to close afterwards.
type Script = fn(&str, &[u8]) -> (Vec<Vec<u8>>, bool);

struct Server {
    url: String,
    /// Connections accepted so far.
    accepted: Arc<AtomicUsize>,
    /// Connections the client closed (the server read their end, or could not write).
    closed_by_client: Arc<AtomicUsize>,
}

async fn server(script: Script) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (accepted, closed_by_client) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (a, c) = (Arc::clone(&accepted), Arc::clone(&closed_by_client));
    tokio::spawn(async move {
        loop {
            let (conn, _) = listener.accept().await.unwrap();
            a.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve_connection(conn, script, Arc::clone(&c)));
        }
    });
    Server { url, accepted, closed_by_client }
}

async fn serve_connection(mut conn: TcpStream, script: Script, closed_by_client: Arc<AtomicUsize>) {
    let mut buf = Vec::new();
    loop {
        let Some(end) = read_until_head_end(&mut conn, &mut buf).await else {
            closed_by_client.fetch_add(1, Ordering::SeqCst);
            return;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_string();
        let length: usize =
            head.lines().find_map(|l| l.strip_prefix("content-length: ")).map_or(0, |v| v.trim().parse().unwrap());
        while buf.len() < end + length {
            let mut more = [0u8; 4096];
            let n = conn.read(&mut more).await.unwrap();
            assert!(n > 0, "the client closed mid-request");
            buf.extend_from_slice(&more[..n]);
        }
        let body = buf[end..end + length].to_vec();
        buf.drain(..end + length);
        let (pieces, close) = script(&head, &body);
        for (i, piece) in pieces.iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if conn.write_all(piece).await.is_err() {
                closed_by_client.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
        if close {
            return;
        }
    }
}

/// The end of the next request head in `buf` (read more as needed); `None` at the client's close.
async fn read_until_head_end(conn: &mut TcpStream, buf: &mut Vec<u8>) -> Option<usize> {
    loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(p + 4);
        }
        let mut more = [0u8; 4096];
        match conn.read(&mut more).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&more[..n]),
        }
    }
}

fn get(url: &str, path: &str) -> Request<Full<Bytes>> {
    Request::get(format!("{url}{path}")).body(Full::new(Bytes::new())).unwrap()
}

fn post(url: &str, path: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::post(format!("{url}{path}")).header("x-test", "1").body(Full::new(Bytes::from(body))).unwrap()
}

async fn text(c: &Client, req: Request<Full<Bytes>>) -> Result<(StatusCode, String), ClientError> {
    let resp = c.request(req).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8(body.to_vec()).unwrap()))
}

/// Answers by path: a length, chunks in pieces, a body until close, and echoes of the request.
fn framings(head: &str, body: &[u8]) -> (Vec<Vec<u8>>, bool) {
    let path = head.split(' ').nth(1).unwrap();
    let piece = |s: &str| s.as_bytes().to_vec();
    match path {
        "/length" => (vec![piece("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")], false),
        "/chunked" => (
            vec![
                piece("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n"),
                piece("9\r\ndata: a\r\n\r\n"),
                piece("9\r\ndata: b\r\n\r\n9\r\ndata: c\r\n\r\n"),
                piece("0\r\n\r\n"),
            ],
            false,
        ),
        "/until-close" => (vec![piece("HTTP/1.1 200 OK\r\n\r\nall"), piece(" of it")], true),
        "/interim" => {
            (vec![piece("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok")], false)
        }
        "/echo" => {
            let mut answer =
                format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", head.len() + body.len()).into_bytes();
            answer.extend_from_slice(head.as_bytes());
            answer.extend_from_slice(body);
            (vec![answer], false)
        }
        _ => (vec![piece("HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")], false),
    }
}

#[tokio::test]
async fn every_framing_is_read_and_kept_connections_are_reused() {
    let s = server(framings).await;
    let c = client(Duration::from_secs(60));
    assert_eq!(text(&c, get(&s.url, "/length")).await.unwrap(), (StatusCode::OK, "hello".into()));
    assert_eq!(c.idle_connections(), 1);
    assert_eq!(text(&c, get(&s.url, "/chunked")).await.unwrap().1, "data: a\r\ndata: b\r\ndata: c\r\n");
    assert_eq!(text(&c, get(&s.url, "/interim")).await.unwrap(), (StatusCode::CREATED, "ok".into()));
    assert_eq!(text(&c, get(&s.url, "/missing")).await.unwrap(), (StatusCode::NOT_FOUND, String::new()));
    // Four exchanges, one connection.
    assert_eq!(s.accepted.load(Ordering::SeqCst), 1);

    // The request as the server got it: the client's framing, the caller's headers.
    let (_, echoed) = text(&c, post(&s.url, "/echo", "{\"a\":1}")).await.unwrap();
    let authority = s.url.trim_start_matches("http://");
    assert_eq!(
        echoed,
        format!("POST /echo HTTP/1.1\r\nhost: {authority}\r\nx-test: 1\r\ncontent-length: 7\r\n\r\n{{\"a\":1}}")
    );
    let (_, echoed) = text(&c, get(&s.url, "/echo")).await.unwrap();
    assert!(!echoed.contains("content-length"), "{echoed}");

    // A body until close: its connection is not kept.
    assert_eq!(text(&c, get(&s.url, "/until-close")).await.unwrap().1, "all of it");
    assert_eq!(c.idle_connections(), 0);
    assert_eq!(text(&c, get(&s.url, "/length")).await.unwrap().1, "hello");
    assert_eq!(s.accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_streamed_body_arrives_as_it_is_written_and_bursts_come_whole() {
    let s = server(framings).await;
    let c = client(Duration::from_secs(60));
    let resp = c.request(get(&s.url, "/chunked")).await.unwrap();
    let mut body = resp.into_body();
    let mut frames = Vec::new();
    while let Some(frame) = body.frame().await {
        frames.push(frame.unwrap().into_data().unwrap());
    }
    // Each write of the server is one frame: the two chunks written together come as one.
    assert_eq!(frames, [&b"data: a\r\n"[..], b"data: b\r\ndata: c\r\n"]);
    assert_eq!(c.idle_connections(), 1);
}

#[tokio::test]
async fn a_connection_the_server_closed_while_idle_is_not_used() {
    fn answer_and_close_soon(_: &str, _: &[u8]) -> (Vec<Vec<u8>>, bool) {
        // HTTP/1.1 keeps the connection by default; the server then closes it while idle.
        (vec![b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec()], true)
    }
    let s = server(answer_and_close_soon).await;
    let c = client(Duration::from_secs(60));
    assert_eq!(text(&c, get(&s.url, "/")).await.unwrap().1, "ok");
    assert_eq!(c.idle_connections(), 1);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(text(&c, get(&s.url, "/")).await.unwrap().1, "ok");
    assert_eq!(s.accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_kept_connection_closed_under_a_request_after_a_long_idle_is_tried_once_more_and_no_other() {
    // The second request a server sees (the first on the kept connection) is read and not
    // answered; the others are, and their connections kept.
    fn unless_second(seen: &AtomicUsize) -> (Vec<Vec<u8>>, bool) {
        match seen.fetch_add(1, Ordering::SeqCst) {
            1 => (vec![], true),
            _ => (vec![b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec()], false),
        }
    }
    static SEEN: AtomicUsize = AtomicUsize::new(0);
    fn drop_the_second(_: &str, _: &[u8]) -> (Vec<Vec<u8>>, bool) {
        unless_second(&SEEN)
    }
    let s = server(drop_the_second).await;
    let c = client(Duration::from_secs(60));
    assert_eq!(text(&c, get(&s.url, "/")).await.unwrap().1, "ok");
    // Idle as long as a server's keep-alive timeout might be: taken as closed by it, not read.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(text(&c, get(&s.url, "/")).await.unwrap().1, "ok");
    assert_eq!((s.accepted.load(Ordering::SeqCst), SEEN.load(Ordering::SeqCst)), (2, 3));

    // Reused at once, the same failure may be a server that read the request (a prefill) and
    // died: an error, not a second send.
    static BUSY_SEEN: AtomicUsize = AtomicUsize::new(0);
    fn drop_the_second_busy(_: &str, _: &[u8]) -> (Vec<Vec<u8>>, bool) {
        unless_second(&BUSY_SEEN)
    }
    let s = server(drop_the_second_busy).await;
    assert_eq!(text(&c, get(&s.url, "/")).await.unwrap().1, "ok");
    let err = text(&c, get(&s.url, "/")).await.unwrap_err();
    assert!(matches!(err, ClientError::Response { error: FramingError::Truncated(_), .. }), "{err}");
    assert_eq!((s.accepted.load(Ordering::SeqCst), BUSY_SEEN.load(Ordering::SeqCst)), (1, 2));

    // On a connection of its own, an unanswered request is an error, not a second try.
    fn never_answer(_: &str, _: &[u8]) -> (Vec<Vec<u8>>, bool) {
        (vec![], true)
    }
    let s = server(never_answer).await;
    let err = text(&c, get(&s.url, "/")).await.unwrap_err();
    assert!(matches!(err, ClientError::Response { error: FramingError::Truncated(_), .. }), "{err}");
    assert_eq!(s.accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn broken_answers_are_errors_and_their_connections_are_dropped() {
    fn broken(head: &str, _: &[u8]) -> (Vec<Vec<u8>>, bool) {
        let path = head.split(' ').nth(1).unwrap();
        let answer: Vec<u8> = match path {
            "/garbage" => b"SSH-2.0-OpenSSH\r\n\r\n".to_vec(),
            "/huge-head" => {
                let mut h = b"HTTP/1.1 200 OK\r\nx-big: ".to_vec();
                h.extend(std::iter::repeat_n(b'a', 100 << 10));
                h
            }
            "/two-lengths" => b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nokk".to_vec(),
            "/short" => b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort".to_vec(),
            "/bad-chunk" => b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n".to_vec(),
            _ => b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n".to_vec(),
        };
        (vec![answer], true)
    }
    let s = server(broken).await;
    let c = client(Duration::from_secs(60));
    let head_error = |r: Result<_, ClientError>| match r {
        Err(ClientError::Response { error, .. }) => error,
        other => panic!("{other:?}"),
    };
    assert!(matches!(head_error(c.request(get(&s.url, "/garbage")).await), FramingError::Head(_)));
    assert_eq!(head_error(c.request(get(&s.url, "/huge-head")).await), FramingError::HeadTooLarge);
    assert_eq!(head_error(c.request(get(&s.url, "/two-lengths")).await), FramingError::ContentLength);
    assert_eq!(head_error(c.request(get(&s.url, "/upgrade")).await), FramingError::SwitchingProtocols);
    for (path, want) in [
        ("/short", FramingError::Truncated("before the body's length was reached")),
        ("/bad-chunk", FramingError::Chunk("no chunk size")),
    ] {
        let body = c.request(get(&s.url, path)).await.unwrap().into_body();
        match body.collect().await {
            Err(ClientError::Response { error, .. }) => assert_eq!(error, want, "{path}"),
            other => panic!("{path}: {other:?}"),
        }
    }
    assert_eq!(c.idle_connections(), 0);
}

#[tokio::test]
async fn connect_failures_say_so_and_bad_uris_are_refused() {
    let c = client(Duration::from_secs(60));
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let err = c.request(get(&format!("http://127.0.0.1:{port}"), "/")).await.unwrap_err();
    assert!(err.is_connect(), "{err}");
    assert!(err.to_string().contains(&format!("127.0.0.1:{port}")), "{err}");
    for uri in ["/relative", "ftp://127.0.0.1/"] {
        let req = Request::builder().method(Method::GET).uri(uri).body(Full::new(Bytes::new())).unwrap();
        let err = c.request(req).await.unwrap_err();
        assert!(matches!(err, ClientError::Uri { .. }) && !err.is_connect(), "{err}");
    }
}

#[tokio::test]
async fn a_body_dropped_early_closes_its_connection_and_idle_ones_expire() {
    let s = server(framings).await;
    let c = client(Duration::from_millis(100));
    let resp = c.request(get(&s.url, "/chunked")).await.unwrap();
    drop(resp);
    assert_eq!(c.idle_connections(), 0);
    until(|| s.closed_by_client.load(Ordering::SeqCst) == 1).await;

    assert_eq!(text(&c, get(&s.url, "/length")).await.unwrap().1, "hello");
    assert_eq!(c.idle_connections(), 1);
    // The sweep closes it once idle past its timeout, with no request to notice.
    until(|| c.idle_connections() == 0 && s.closed_by_client.load(Ordering::SeqCst) == 2).await;
}

async fn until(mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "timed out");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
