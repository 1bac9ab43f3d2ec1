/* Out-of-line wrappers over libfabric's static inline calls (they dispatch through the
 * objects' ops tables, so bindgen sees no symbol to link). Same arguments, `xf_` prefix. */
#ifndef XFER_LIBFABRIC_SHIM_H
#define XFER_LIBFABRIC_SHIM_H
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>

uint32_t xf_header_version(void);
struct fi_info *xf_allocinfo(void);
int xf_close(struct fid *fid);
int xf_control(struct fid *fid, int command, void *arg);
int xf_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
int xf_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context);
int xf_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context);
int xf_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *context);
int xf_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context);
int xf_cntr_open(struct fid_domain *domain, struct fi_cntr_attr *attr, struct fid_cntr **cntr, void *context);
uint64_t xf_cntr_read(struct fid_cntr *cntr);
int xf_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int xf_enable(struct fid_ep *ep);
int xf_getname(struct fid_ep *ep, void *addr, size_t *addrlen);
int xf_setname(struct fid_ep *ep, void *addr, size_t addrlen);
int xf_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags, void *context);
int xf_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags);
int xf_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access, uint64_t offset,
              uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context);
uint64_t xf_mr_key(struct fid_mr *mr);
void *xf_mr_desc(struct fid_mr *mr);
int xf_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int xf_mr_enable(struct fid_mr *mr);
ssize_t xf_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t xf_cq_sread(struct fid_cq *cq, void *buf, size_t count, const void *cond, int timeout);
int xf_cq_signal(struct fid_cq *cq);
ssize_t xf_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
const char *xf_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len);
ssize_t xf_readmsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t xf_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t xf_send(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr, void *context);
ssize_t xf_recv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src_addr, void *context);
#endif
