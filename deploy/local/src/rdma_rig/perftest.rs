//! perftest (`ib_write_bw`, `ib_send_lat`) between the rig's two guests: the
//! raw-verbs baseline the RDMA lane is measured against, in the same run on
//! the same rxe pair. The server runs on node 2, the client on node 1, both on
//! `rxe0` with the RoCE v2 IPv4 GID (`-x <index>`).

use super::{underlay_addr, RdmaRig};
use anyhow::{bail, Context, Result};
use std::time::Duration;

/// `ib_write_bw`'s result (one RC QP, RDMA WRITE).
#[derive(Debug, Clone, PartialEq)]
pub struct WriteBw {
    pub msg_bytes: u64,
    pub iterations: u64,
    pub peak_gbit_s: f64,
    pub avg_gbit_s: f64,
    pub msg_rate_mpps: f64,
}

impl WriteBw {
    /// Average bandwidth in bytes per second (perftest's Gb are 10^9 bits).
    pub fn avg_bytes_per_sec(&self) -> f64 {
        self.avg_gbit_s * 1e9 / 8.0
    }
}

/// `ib_send_lat`'s result (one RC QP, SEND ping-pong; half round trips, µs).
#[derive(Debug, Clone, PartialEq)]
pub struct SendLat {
    pub msg_bytes: u64,
    pub iterations: u64,
    pub min_us: f64,
    pub max_us: f64,
    pub typical_us: f64,
    pub avg_us: f64,
    pub stdev_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
}

/// The result table of a perftest run: the header line starting with
/// `#bytes` and the numbers below it. Column names are `#word` or end with a
/// unit in brackets (`BW peak[Gb/sec]`, `99% percentile[usec]`); the blanks
/// between them vary (`#bytes #iterations` has one).
pub fn parse_table(output: &str) -> Option<Vec<(String, f64)>> {
    let mut lines = output.lines();
    let header = lines.find(|l| l.trim_start().starts_with("#bytes"))?;
    let mut names: Vec<String> = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    for word in header.split_whitespace() {
        current.push(word);
        if word.starts_with('#') || word.ends_with(']') {
            names.push(current.join(" "));
            current.clear();
        }
    }
    if !current.is_empty() {
        return None;
    }
    let values: Vec<f64> = lines
        .find(|l| !l.trim().is_empty())?
        .split_whitespace()
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    (names.len() == values.len()).then(|| names.into_iter().zip(values).collect())
}

fn column(table: &[(String, f64)], prefix: &str) -> Result<f64> {
    table
        .iter()
        .find(|(name, _)| name.starts_with(prefix))
        .map(|(_, v)| *v)
        .with_context(|| format!("no column {prefix:?} in {table:?}"))
}

/// Parses `ib_write_bw --report_gbits` output.
pub fn parse_write_bw(output: &str) -> Result<WriteBw> {
    let t = parse_table(output).context("no ib_write_bw result table")?;
    if !t.iter().any(|(n, _)| n.contains("[Gb/sec]")) {
        bail!("ib_write_bw was not run with --report_gbits: {t:?}");
    }
    Ok(WriteBw {
        msg_bytes: column(&t, "#bytes")? as u64,
        iterations: column(&t, "#iterations")? as u64,
        peak_gbit_s: column(&t, "BW peak")?,
        avg_gbit_s: column(&t, "BW average")?,
        msg_rate_mpps: column(&t, "MsgRate")?,
    })
}

/// Parses `ib_send_lat` output.
pub fn parse_send_lat(output: &str) -> Result<SendLat> {
    let t = parse_table(output).context("no ib_send_lat result table")?;
    Ok(SendLat {
        msg_bytes: column(&t, "#bytes")? as u64,
        iterations: column(&t, "#iterations")? as u64,
        min_us: column(&t, "t_min")?,
        max_us: column(&t, "t_max")?,
        typical_us: column(&t, "t_typical")?,
        avg_us: column(&t, "t_avg")?,
        stdev_us: column(&t, "t_stdev")?,
        p99_us: column(&t, "99% percentile")?,
        p999_us: column(&t, "99.9% percentile")?,
    })
}

/// The GID index of `::ffff:<underlay>` (RoCE v2) on node 1's `rxe0`; both
/// guests build their table the same way.
fn ipv4_gid_index(rig: &RdmaRig) -> Result<u32> {
    let out = rig.run_ok(
        1,
        r#"for g in /sys/class/infiniband/$RIG_RDMA_DEV/ports/1/gids/*; do
  i=${g##*/}
  [ "$(cat /sys/class/infiniband/$RIG_RDMA_DEV/ports/1/gid_attrs/types/$i 2>/dev/null)" = "RoCE v2" ] &&
    grep -q '^0000:0000:0000:0000:0000:ffff:' "$g" && { echo "$i"; exit 0; }
done
exit 1"#,
        Duration::from_secs(30),
    );
    out.stdout
        .trim()
        .parse()
        .context("GID index of the IPv4-mapped RoCE v2 GID")
}

/// Runs `tool args` as server on node 2 and client on node 1 (to node 2's
/// underlay address) and returns the client's output.
pub fn run_pair(rig: &RdmaRig, tool: &str, args: &str, timeout: Duration) -> Result<String> {
    let secs = timeout.as_secs().max(10);
    // The server is started in the background and the job returns once it
    // listens on perftest's TCP port (18515), so the client never races it.
    let server = rig.run(
        2,
        &format!(
            r#"rm -f /tmp/perftest.out /tmp/perftest.pid
timeout {secs} {tool} {args} >/tmp/perftest.out 2>&1 & echo $! >/tmp/perftest.pid
for _ in $(seq 1 600); do
  ss -ltn | grep -q ':18515 ' && exit 0
  kill -0 "$(cat /tmp/perftest.pid)" 2>/dev/null || {{ cat /tmp/perftest.out; exit 1; }}
  sleep 0.1
done
echo "{tool} server did not listen on 18515"; exit 1"#
        ),
        Duration::from_secs(90),
    )?;
    if !server.success() {
        bail!("{tool} server on node2: {}{}", server.stdout, server.stderr);
    }
    let client = rig.run(
        1,
        &format!("{tool} {args} {}", underlay_addr(2)),
        Duration::from_secs(secs),
    )?;
    let server_out = rig.run(
        2,
        "pid=$(cat /tmp/perftest.pid); while kill -0 $pid 2>/dev/null; do sleep 0.1; done; cat /tmp/perftest.out",
        Duration::from_secs(secs),
    )?;
    if !client.success() {
        bail!(
            "{tool} client on node1 failed (exit {}):\n{}{}\nserver:\n{}",
            client.status,
            client.stdout,
            client.stderr,
            server_out.stdout
        );
    }
    Ok(client.stdout)
}

/// perftest converts CPU cycles to time with a clock rate it measures at
/// start (a linear fit of cycles against gettimeofday). On a loaded host a
/// TCG guest's clocks jitter, the fit fails (perftest warns "Correlation
/// coefficient r^2 ... < 0.9") and every figure of that run reads 0. Such a
/// run is repeated, up to this many runs in all.
const CLOCK_FIT_ATTEMPTS: usize = 3;

/// Runs a pair until `parse` yields figures that are not all zero.
fn run_measured<T>(
    rig: &RdmaRig,
    tool: &str,
    args: &str,
    timeout: Duration,
    parse: impl Fn(&str) -> Result<T>,
    valid: impl Fn(&T) -> bool,
) -> Result<T> {
    let mut last = String::new();
    for _ in 0..CLOCK_FIT_ATTEMPTS {
        let out = run_pair(rig, tool, args, timeout)?;
        let figures = parse(&out).with_context(|| format!("{tool} output:\n{out}"))?;
        if valid(&figures) {
            return Ok(figures);
        }
        last = out;
    }
    bail!("{tool} measured nothing in {CLOCK_FIT_ATTEMPTS} runs (clock-rate fit failed?); last output:\n{last}")
}

/// `ib_write_bw` for `seconds` with `msg_bytes` messages, node 1 → node 2.
pub fn ib_write_bw(rig: &RdmaRig, msg_bytes: u32, seconds: u32) -> Result<WriteBw> {
    let gid = ipv4_gid_index(rig)?;
    let args = format!("-d rxe0 -x {gid} -F -s {msg_bytes} -D {seconds} --report_gbits");
    run_measured(
        rig,
        "ib_write_bw",
        &args,
        Duration::from_secs(u64::from(seconds) + 90),
        parse_write_bw,
        |r| r.iterations > 0 && r.avg_gbit_s > 0.0,
    )
}

/// `ib_send_lat` with `iterations` ping-pongs of `msg_bytes`, node 1 ↔ node 2.
pub fn ib_send_lat(rig: &RdmaRig, msg_bytes: u32, iterations: u32) -> Result<SendLat> {
    let gid = ipv4_gid_index(rig)?;
    let args = format!("-d rxe0 -x {gid} -F -s {msg_bytes} -n {iterations}");
    run_measured(
        rig,
        "ib_send_lat",
        &args,
        Duration::from_secs(120),
        parse_send_lat,
        |r| r.min_us > 0.0 && r.typical_us > 0.0,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    // Verbatim tables from perftest 4.5 in the rig (tabs included).
    const WRITE_BW: &str = "\
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 65536      2000           0.130686            0.054921            0.000105
---------------------------------------------------------------------------------------
";
    const SEND_LAT: &str = "\
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 2       1000          192.56         3133.75      282.33   \t       420.51      \t436.30 \t\t2474.31 \t\t3133.75
---------------------------------------------------------------------------------------
";

    #[test]
    fn write_bw_table_is_parsed() {
        let r = parse_write_bw(WRITE_BW).unwrap();
        assert_eq!(r.msg_bytes, 65536);
        assert_eq!(r.iterations, 2000);
        assert_eq!(r.avg_gbit_s, 0.054921);
        assert_eq!(r.peak_gbit_s, 0.130686);
        assert!((r.avg_bytes_per_sec() - 6_865_125.0).abs() < 1.0);
    }

    #[test]
    fn send_lat_table_is_parsed() {
        let r = parse_send_lat(SEND_LAT).unwrap();
        assert_eq!(r.msg_bytes, 2);
        assert_eq!(r.iterations, 1000);
        assert_eq!(r.typical_us, 282.33);
        assert_eq!(r.p99_us, 2474.31);
        assert_eq!(r.p999_us, 3133.75);
    }

    #[test]
    fn megabyte_tables_and_garbage_are_refused() {
        let mb = WRITE_BW.replace("Gb/sec", "MB/sec");
        assert!(parse_write_bw(&mb).is_err());
        assert!(parse_write_bw("Couldn't connect to 192.168.47.2:18515").is_err());
        assert!(parse_send_lat(" #bytes #iterations\n 2 x\n").is_err());
    }
}
